"""The hybrid's speculative config for vLLM (backends/vllm/drafting.py): the draft vLLM verifies is
the trees' longest, made a multiple of what one call of an MTP model predicts (vLLM refuses a
longer draft that is not), read from the config on disk."""

import json

import pytest

from agentaccel.backends.vllm.drafting import DEFAULT_SPECULATIVE_CONFIG, hybrid_config, predict_layers

EAGLE3 = {"method": "eagle3", "model": "heads/eagle3", "num_speculative_tokens": 3}


@pytest.mark.parametrize(("k", "n_predict", "verified"), [(3, 1, 32), (3, 3, 33), (2, 2, 32), (4, 5, 35),
                                                          (40, 3, 42), (1, 64, 32)])
def test_the_verified_draft_is_a_multiple_of_what_one_call_of_the_drafter_predicts(k, n_predict, verified):
    config, model_tokens = hybrid_config({"method": "mtp", "num_speculative_tokens": k}, n_predict=n_predict)
    assert model_tokens == k and config["num_speculative_tokens"] == verified
    # vLLM's own rule (vllm/config/speculative.py): longer than n_predict means a multiple of it
    assert verified <= n_predict or verified % n_predict == 0
    assert verified >= max(k, DEFAULT_SPECULATIVE_CONFIG["num_speculative_tokens"])


def test_what_one_call_predicts_is_read_from_the_models_config(tmp_path):
    def model(name: str, config: dict | None) -> str:
        folder = tmp_path / name
        folder.mkdir()
        if config is not None:
            (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    deepseek = model("deepseek-like", {"model_type": "deepseek_v3", "num_nextn_predict_layers": 3})
    qwen = model("qwen-like", {"model_type": "qwen3_5", "text_config": {"mtp_num_hidden_layers": 2}})
    plain = model("plain", {"model_type": "llama"})
    assert predict_layers({"method": "mtp", "num_speculative_tokens": 3}, deepseek) == 3  # the served model's
    assert predict_layers({"method": "mtp", "num_speculative_tokens": 3}, qwen) == 2
    assert predict_layers({"method": "mtp", "model": deepseek, "num_speculative_tokens": 3}, plain) == 3
    assert predict_layers(EAGLE3, plain) == 1  # a head not on disk: nothing said
    assert predict_layers({"method": "eagle3", "model": plain, "num_speculative_tokens": 3}, deepseek) == 1
    assert predict_layers({"method": "mtp", "num_speculative_tokens": 3}, model("broken", None)) == 1
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert predict_layers({"method": "mtp", "num_speculative_tokens": 3}, str(tmp_path / "broken")) == 1


def test_a_drafter_that_skips_steps_keeps_prefix_cache_hits_whole():
    """vLLM recomputes the last block of every prefix-cache hit for an EAGLE-like head; where the
    hybrid's drafter may skip steps (most requests of a cold stage unfollowed) the hit is kept
    whole, unless the drafter's own config says otherwise; a drafter run every step keeps vLLM's
    drop."""
    assert hybrid_config(EAGLE3)[0]["disable_eagle_block_drop"] is True
    assert "disable_eagle_block_drop" not in hybrid_config(EAGLE3, skips=False)[0]
    assert hybrid_config({**EAGLE3, "disable_eagle_block_drop": False})[0]["disable_eagle_block_drop"] is False


def test_the_plugin_drafts_with_its_own_floor_and_vllms_suffix_with_vllms(tmp_path):
    from types import SimpleNamespace

    from agentaccel.backends.vllm.backend import VLLMBackend, VLLMSettings
    from agentaccel.backends.vllm.drafting import PLUGIN_MIN_TOKEN_PROB, VLLM_MIN_TOKEN_PROB, plugin_drafting
    from agentaccel.bench.vllm.servers import METHODS
    from agentaccel.simulation import methods

    # what `serve --backend vllm` starts vLLM with (nothing is started here)
    argv = VLLMBackend(VLLMSettings(model=str(tmp_path), db=str(tmp_path / "t.db"))).supervisor.argv
    started = json.loads(argv[argv.index("--speculative-config") + 1])
    assert plugin_drafting(started).config.min_prob == PLUGIN_MIN_TOKEN_PROB < VLLM_MIN_TOKEN_PROB
    for method in ("agentaccel", "agentaccel-request", "agentaccel-off"):  # bench vllm's servers
        assert plugin_drafting(METHODS[method]).config.min_prob == PLUGIN_MIN_TOKEN_PROB, method
    (simulated,) = methods.build(["agentaccel"])  # the simulators draft as the plugin does
    assert simulated.engine.config.min_prob == PLUGIN_MIN_TOKEN_PROB
    # vLLM's own suffix decoding, the baseline, runs as vLLM users run it
    assert "suffix_decoding_min_token_prob" not in METHODS["suffix"]
    # a config that names its own floor is obeyed; a `vllm serve` started by hand hands the plugin
    # vLLM's SpeculativeConfig, which always carries vLLM's default
    assert plugin_drafting({**started, "suffix_decoding_min_token_prob": 0.3}).config.min_prob == 0.3
    by_hand = SimpleNamespace(method="suffix", num_speculative_tokens=32, suffix_decoding_max_tree_depth=64,
                              suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=VLLM_MIN_TOKEN_PROB)
    assert plugin_drafting(by_hand).config.min_prob == VLLM_MIN_TOKEN_PROB
    # the hybrid's trees keep the floor beside the head
    assert hybrid_config(EAGLE3)[0]["suffix_decoding_min_token_prob"] == PLUGIN_MIN_TOKEN_PROB
