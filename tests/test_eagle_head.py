"""An EAGLE head for the bundled model (backends/local/eagle_head.py): its layer is a Llama decoder
layer without its input norm (what vLLM's eagle method runs), it is written with the weight names
vLLM loads, its chains match a plain recomputation, and `bench vllm` runs it with vLLM's eagle
method (a cut model with draft-model speculation)."""

import json

import pytest
import torch
from safetensors import safe_open

from agentaccel.backends.local.draft_model import cut_model, drafter_folder
from agentaccel.backends.local.eagle_head import (
    HeadAsModel,
    copy_layer,
    from_target,
    greedy_chains,
    is_eagle_head,
    load_head,
    save_head,
)
from agentaccel.backends.local.model import default_model_folder
from agentaccel.bench.vllm.servers import drafter_config

IDS = torch.tensor([1, 4093, 314, 253, 1345, 28, 17, 1064, 30, 2, 4093, 314, 253, 1345, 28, 17, 1064, 30])

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_folder()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    head = from_target(target).eval()
    with torch.no_grad():  # away from the copy of the target's layer, so that nothing passes by luck
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
        layer = head.layers[0]  # its updates small, as a trained head's: its own states stay in scale,
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)
        layer.self_attn.q_proj.weight.mul_(0.02)  # and its attention soft: every key it sees counts
    return head


def test_the_heads_layer_is_a_llama_layer_without_its_input_norm(target, head):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = target.config
    reference = LlamaDecoderLayer(config, layer_idx=0).eval()
    reference.input_layernorm = torch.nn.Identity()
    copy_layer(head.layers[0], reference)
    embedding = target.get_input_embeddings().weight
    with torch.inference_mode():
        states = target(IDS[None], output_hidden_states=True).hidden_states[-1]
        x = head.fc(torch.cat([embedding[IDS[1:]][None], states[:, :-1]], -1))
        positions = torch.arange(len(IDS) - 1)[None] + 5  # positions need not start at 0
        expected = reference(x, position_embeddings=LlamaRotaryEmbedding(config)(x, positions),
                             position_ids=positions)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got, _ = head(embedding[IDS[1:]][None], states[:, :-1], positions)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_the_head_is_written_as_vllms_eagle_method_loads_it(target, head, tmp_path):
    folder = save_head(head, default_model_folder(), tmp_path / "eagle")
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    layer = "layers.0."
    assert names == {"fc.weight", *(f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"),
                     f"{layer}post_attention_layernorm.weight",
                     *(f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}  # no input norm, no head
    again = load_head(folder)
    embedding = target.get_input_embeddings().weight
    with torch.inference_mode():
        states = target(IDS[None], output_hidden_states=True).hidden_states[-1]
        args = (embedding[IDS[1:]][None], states[:, :-1], torch.arange(len(IDS) - 1)[None])
        assert torch.equal(head(*args)[0], again(*args)[0])
    # bench vllm: the head with vLLM's eagle method, a cut model with draft-model speculation
    assert is_eagle_head(folder) and drafter_config(folder, 3)["method"] == "eagle"
    cut = cut_model(default_model_folder(), 2, tmp_path / "cut2")
    assert not is_eagle_head(cut) and drafter_config(cut, 3)["method"] == "draft_model"
    assert drafter_folder(folder) == folder
    with pytest.raises(ValueError, match="not an EAGLE head"):
        load_head(cut)


def test_chains_match_a_plain_recomputation(target, head):
    """Each chain step from start p recomputed from scratch: the target's states and tokens up to
    p + 1, then the head's own states and drafted tokens, causal, no cache."""
    embedding = target.get_input_embeddings().weight
    with torch.inference_mode():
        states = target(IDS[None], output_hidden_states=True).hidden_states[-1][0]
        starts = torch.tensor([0, 3, 7, len(IDS) - 2])
        chains, chain_states = greedy_chains(head, embedding, IDS, states, starts, 4)
        for row, p in enumerate(starts.tolist()):
            tokens, given = IDS[1:p + 2].tolist(), list(states[:p + 1])
            drafted = []
            for _ in range(4):
                out, _ = head(embedding[torch.tensor(tokens)][None], torch.stack(given)[None],
                              torch.arange(len(tokens))[None])
                drafted.append(int((out[0, -1] @ embedding.T).argmax()))
                tokens.append(drafted[-1])
                given.append(out[0, -1])
            assert chains[row].tolist() == drafted, (p, chains[row].tolist(), drafted)
            expected = torch.stack(given[p + 1:])  # an untrained head's own states grow step by step: relative
            assert ((chain_states[row] - expected).abs().amax(-1) / expected.abs().amax(-1)).max() < 1e-5, p


def test_the_head_as_a_model_predicts_each_next_token_from_the_state_before(target, head):
    embedding = target.get_input_embeddings().weight
    with torch.inference_mode():
        logits = HeadAsModel(target, head)(IDS[None]).logits[0]
        states = target(IDS[None], output_hidden_states=True).hidden_states[-1][0]
        out, _ = head(embedding[IDS[1:]][None], states[:-1][None], torch.arange(len(IDS) - 1)[None])
        assert logits.shape == (len(IDS), embedding.shape[0])
        assert torch.allclose(logits[1:], out[0] @ embedding.T)  # logits[j] predicts token j + 1, from state j - 1


def test_an_unrolled_training_step_learns_from_the_heads_own_states(target, head):
    """scripts/train_eagle_head.py --unroll 2: beside the next state from the target's, the head is
    taught the state after it from its own prediction of the next (as its chains draft): the loss
    is the first step's and, weighted, the second's recomputed here from the first's output."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "train_eagle_head.py"
    spec = importlib.util.spec_from_file_location("train_eagle_head", path)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    embedding = target.get_input_embeddings().weight.detach()
    with torch.inference_mode():
        item = train.target_pass(target, IDS.tolist(), 8)
    item = {k: v.clone() for k, v in item.items()}
    one, agree = train.head_loss(head, embedding, item, 0.0, 0.1, unroll=1)
    two, agree_two = train.head_loss(head, embedding, item, 0.0, 0.1, unroll=2)
    with torch.no_grad():
        states = item["states"].float()
        first, _ = head(embedding[IDS[1:]][None], states[:-1][None], torch.arange(len(IDS) - 1)[None])
        own = first[0, :-1]  # its state at p + 1, for the token at p + 2, at position p + 1
        second, _ = head(embedding[IDS[2:]][None], own[None], torch.arange(1, len(IDS) - 1)[None])
        second = second[0]
        logprobs = (second @ embedding.T).log_softmax(-1)
        cross = -(item["top_logprobs"][2:].float().exp() * logprobs.gather(1, item["top_ids"][2:].long())).sum(-1)
        expected = torch.nn.functional.smooth_l1_loss(second, states[2:]) + 0.1 * cross.mean()
    assert agree == agree_two
    assert torch.isclose(two - one, train.UNROLL_DECAY * expected, rtol=1e-4), (two - one, expected)
    two.backward()  # the second step's loss reaches the weights through the first step's states too
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    head.zero_grad(set_to_none=True)
