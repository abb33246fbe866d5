"""How the vLLM plugin drafts, read from vLLM's speculative config: built here once for the
plugin's proposer and for every simulator of it (`bench server`, `bench simulate-vllm`, the
scripts), so that a simulated `agentaccel` drafts as the real one does. No vLLM import: the
simulators run without vLLM."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from agentaccel.engine import SpecConfig
from agentaccel.engine.cost import parse
from agentaccel.engine.policy import default_config

# What `bench vllm` starts vLLM's own suffix decoding with: the longest draft and the trees' depth
DEFAULT_SPECULATIVE_CONFIG = {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64}
# vLLM's own defaults for what the config leaves out (vllm/config/speculative.py)
VLLM_SPEC_FACTOR = 1.0  # suffix_decoding_max_spec_factor
VLLM_MIN_TOKEN_PROB = 0.1  # suffix_decoding_min_token_prob
# The plugin's floor under a drafted token's D. vLLM's 0.1 is made for ArcticInference's
# frequencies; the plugin's D is calibrated and its step budget already weighs each token's chance
# against what the step pays for it, so a lower floor only lets the budget keep the long, cheap
# tails a GPU verifies almost free at low load (BENCHMARKS.md, "GPU: against vLLM's next suffix
# decoding")
PLUGIN_MIN_TOKEN_PROB = 0.02
# What `serve --backend vllm` and `bench vllm`'s agentaccel methods start vLLM with, unless the
# user gives their own: the same knobs as vLLM's suffix, the plugin's own floor
PLUGIN_SPECULATIVE_CONFIG = {**DEFAULT_SPECULATIVE_CONFIG, "suffix_decoding_min_token_prob": PLUGIN_MIN_TOKEN_PROB}
VLLM_TREE_DEPTH = 24  # suffix_decoding_max_tree_depth (and num_speculative_tokens when not given)
# The model drafter's chain a step (its num_speculative_tokens) where a benchmark names none: vLLM's
# EAGLE and draft-model examples draft 3 to 5; `bench vllm` runs it, the simulators draft it
DEFAULT_MODEL_TOKENS = 3
HYBRID_METHODS = ("eagle", "eagle3", "mtp")  # vLLM's EagleProposer: it drafts after the sampled tokens reach the CPU


def hybrid_config(drafter: Mapping, trees: Mapping = PLUGIN_SPECULATIVE_CONFIG,
                  n_predict: int = 1, skips: bool = True) -> tuple[dict, int]:
    """vLLM's speculative config for the hybrid (hybrid.py) from a model drafter's (`{"method":
    "eagle3", "model": ..., "num_speculative_tokens": 3}`: what its user runs it with) and the
    trees' (their longest draft and depth): vLLM verifies drafts as long as the trees', runs the
    drafter after the step's sampled tokens reach the CPU, and the drafter's own draft length comes
    back as the second value (the settings' `model_tokens`). `n_predict`: the tokens one call of the
    drafter's model predicts (`predict_layers`; vLLM requires a longer draft to be a multiple of it).
    `skips`: the drafter may skip steps (the plugin's drafter_skip is not "never"): then vLLM keeps
    a prompt's whole prefix-cache hit rather than recomputing its last block for the head, unless
    the drafter's config says otherwise."""
    if drafter.get("method") not in HYBRID_METHODS:
        # vLLM 0.32 runs a draft model (draft_model) only on its padded path, before the step's
        # sampled tokens reach the CPU, where the trees cannot draft yet
        raise ValueError(f"the hybrid runs beside vLLM's {', '.join(HYBRID_METHODS)} drafters, "
                         f"not method {drafter.get('method')!r}")
    if drafter.get("draft_sample_method", "greedy") != "greedy":
        # vLLM keeps the head's draft probabilities and judges every drafted row by them, the rows
        # sent the trees' drafts included: tree tokens against probabilities of other tokens, and
        # tree drafts longer than the head's passes with fewer rows than tokens
        raise ValueError(f"the hybrid drafts greedily: draft_sample_method {drafter['draft_sample_method']!r} would "
                         "judge the trees' drafts by the head's probabilities for its own tokens; leave it out")
    model_tokens = drafter.get("num_speculative_tokens")
    if not isinstance(model_tokens, int) or isinstance(model_tokens, bool) or model_tokens < 1:
        raise ValueError(f"the drafter's num_speculative_tokens (its chain a step) must be an integer >= 1, "
                         f"got {model_tokens!r}")
    verified = max(model_tokens, int(trees["num_speculative_tokens"]))
    if verified > n_predict and verified % n_predict:  # an MTP model of several prediction layers
        verified += n_predict - verified % n_predict
    config = {**drafter, "disable_padded_drafter_batch": True, "num_speculative_tokens": verified}
    config.setdefault("suffix_decoding_max_tree_depth", trees.get("suffix_decoding_max_tree_depth", VLLM_TREE_DEPTH))
    config.setdefault("suffix_decoding_min_token_prob",
                      trees.get("suffix_decoding_min_token_prob", VLLM_MIN_TOKEN_PROB))
    if skips:
        # vLLM drops the last block of every prefix-cache hit when a head drafts, so that the head's
        # KV at the hit's last position (written with the next token of the request that computed
        # it) is recomputed: a block of prefill per hit, paid by every request. Where the drafter
        # skips, most requests of a cold stage are never followed and need none of the head's KV; a
        # followed one drafts over that one position stale (accepted less, never wrong).
        config.setdefault("disable_eagle_block_drop", True)
    return config, model_tokens


# where a model's config says how many tokens one call of its drafter predicts (vLLM's n_predict,
# which it derives from these for MTP models), top level or in its text_config
PREDICT_FIELDS = ("n_predict", "num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")


def predict_layers(drafter: Mapping, model: str) -> int:
    """The tokens one call of the drafter's model predicts, read from its config.json (an MTP
    drafter's model is the served `model` itself unless it names one); 1 where the config is not
    on disk or says nothing."""
    config = Path(str(drafter.get("model") or model)).expanduser() / "config.json"
    try:
        found = json.loads(config.read_text())
    except (OSError, ValueError):
        return 1
    for place in (found, found.get("text_config") if isinstance(found, dict) else None):
        if isinstance(place, dict):
            for name in PREDICT_FIELDS:
                value = place.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                    return value
    return 1


@dataclass(frozen=True)
class PluginDrafting:
    config: SpecConfig  # every stage's policy before tuned settings: one chain, vLLM's longest draft, alpha, min-prob
    depth: int  # the trees' depth (suffix_decoding_max_tree_depth)
    max_tokens: int  # the longest draft vLLM verifies (num_speculative_tokens)


def plugin_drafting(speculative: Mapping | object = PLUGIN_SPECULATIVE_CONFIG) -> PluginDrafting:
    """The plugin's drafting set-up for vLLM's speculative config (its SpeculativeConfig inside
    vLLM, or the JSON a server is started with: default, the managed backend's). vLLM verifies
    one chain, priced per token as on a GPU until the step budget learns the server; the longest
    draft, the spec factor (alpha) and the min token probability are vLLM's own settings."""
    def get(name: str, default):
        value = speculative.get(name) if isinstance(speculative, Mapping) else getattr(speculative, name, None)
        return default if value is None else value

    depth = int(get("suffix_decoding_max_tree_depth", VLLM_TREE_DEPTH))
    max_tokens = int(get("num_speculative_tokens", depth))
    config = replace(default_config(parse("gpu"), tree=False), max_tokens=max_tokens,
                     alpha=float(get("suffix_decoding_max_spec_factor", VLLM_SPEC_FACTOR)),
                     min_prob=float(get("suffix_decoding_min_token_prob", VLLM_MIN_TOKEN_PROB)))
    return PluginDrafting(config, depth, max_tokens)
