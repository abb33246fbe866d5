"""AgentaccelProposer: vLLM's suffix proposer interface, drafting from SuffixEngine.

Read once at start: vLLM's speculative config (`num_speculative_tokens` caps a draft,
`suffix_decoding_max_tree_depth` is the engine depth, `suffix_decoding_max_spec_factor` alpha,
`suffix_decoding_min_token_prob` min-prob) and the environment the managed launcher sets:

* `AGENTACCEL_DB` + `AGENTACCEL_SEED=1`: seed the stage trees from the trace store;
* `AGENTACCEL_SPEC_CONFIG`: per-stage drafting settings (JSON, see engine.stage_config);
* `AGENTACCEL_MEMORY_BUDGET`: bytes for the global trees;
* `AGENTACCEL_VLLM_STATS`: a JSON file where per-stage draft statistics are written (the proxy's
  /metrics reads it).

Each request's stage comes from `SamplingParams.extra_args["stage"]` (the proxy sends it as
`vllm_xargs.stage`); `extra_args["speculate"] = false` makes one request a baseline inside the
same server: no drafts, and its output is not learned from. vLLM verifies a chain of draft tokens, so drafts are linear.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.stage_config import load_stage_specs

log = logging.getLogger("agentaccel.vllm")

# req_id -> (stage, speculate?), filled as the worker's input batch admits requests (see _capture_stages).
_REQUESTS: dict[str, tuple[str, bool]] = {}


def _capture_stages() -> None:
    """Remembers each request's stage when vLLM adds it to the input batch: the proposer only
    sees the batch, and the batch keeps no sampling params."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    if getattr(InputBatch.add_request, "_agentaccel", False):
        return
    original = InputBatch.add_request

    def add_request(self, request):
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        stage = extra.get("stage")
        _REQUESTS[request.req_id] = (stage if isinstance(stage, str) and stage else "default",
                                     extra.get("speculate", True) not in (False, 0, "0", "false"))
        return original(self, request)

    add_request._agentaccel = True
    InputBatch.add_request = add_request


def _tokenizer_file(spec: str) -> str:
    """A local folder as it is; a hub model name -> the tokenizer.json vLLM already has in the HF
    cache (nothing is downloaded here)."""
    if Path(spec).exists():
        return spec
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return spec
    cached = try_to_load_from_cache(spec, "tokenizer.json")
    return cached if isinstance(cached, str) else spec


class AgentaccelProposer:
    def __init__(self, vllm_config) -> None:
        config = vllm_config.speculative_config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        base = SpecConfig(tree=False, alpha=config.suffix_decoding_max_spec_factor,
                          min_prob=config.suffix_decoding_min_token_prob, cost=0.02)
        self.spec, self.stage_specs = base, {}
        if os.environ.get("AGENTACCEL_SPEC_CONFIG"):
            self.spec, self.stage_specs = load_stage_specs(os.environ["AGENTACCEL_SPEC_CONFIG"], base)
        budget = int(os.environ.get("AGENTACCEL_MEMORY_BUDGET", "0"))
        self.engine = SuffixEngine(max_depth=config.suffix_decoding_max_tree_depth, memory_budget_bytes=budget)
        self.stats_path = os.environ.get("AGENTACCEL_VLLM_STATS")
        self.stats: dict[str, dict[str, int]] = {}
        self._last_draft: dict[str, int] = {}  # req_id -> length of its pending draft
        _capture_stages()
        if os.environ.get("AGENTACCEL_SEED") == "1" and os.environ.get("AGENTACCEL_DB"):
            self._seed(vllm_config)

    def _seed(self, vllm_config) -> None:
        from agentaccel.engine.seeding import seed_from_store
        from agentaccel.traces.store import TraceStore
        from agentaccel.traces.tokenization import load_tokenizer

        try:
            tokenizer = load_tokenizer(_tokenizer_file(vllm_config.model_config.tokenizer))
        except ValueError as e:
            log.warning("agentaccel: not seeding, no usable tokenizer (%s)", e)
            return
        with TraceStore(os.environ["AGENTACCEL_DB"]) as store:
            report = seed_from_store(self.engine, store, tokenizer)
        log.info("agentaccel: seeded %d outputs (%d tokens, %d stages)", report.calls, report.tokens, report.stages)

    def propose(self, num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=None) -> list[list[int]]:
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill
                drafts.append([])
                continue
            req_id = input_batch.req_ids[i]
            num_tokens = int(input_batch.num_tokens_no_spec[i])
            stage, speculate = _REQUESTS.get(req_id, ("default", True))
            if not self.engine.has_request(req_id):
                # Everything before this step's tokens: the prompt, and after a preemption also what
                # the request generated before it (vLLM re-adds preempted requests as new ones).
                context = input_batch.token_ids_cpu[i, : num_tokens - len(sampled)]
                self.engine.start_request(req_id, context, stage=stage)
            self.engine.extend(req_id, list(sampled))
            if speculate:
                self._count(stage, req_id, len(sampled))
            budget = min(num_speculative_tokens, self.num_speculative_tokens, self.max_model_len - num_tokens - 1)
            tokens: list[int] = []
            if budget > 0 and speculate:
                tokens = list(self.engine.speculate(req_id, budget, self.stage_specs.get(stage, self.spec)).token_ids)
            self._last_draft[req_id] = len(tokens)
            drafts.append(tokens)
        live = set(input_batch.req_id_to_index)
        for req_id in [r for r in self._last_draft if r not in live]:  # finished (or preempted) requests
            self._last_draft.pop(req_id)
            _, speculated = _REQUESTS.pop(req_id, ("default", True))
            if self.engine.has_request(req_id):  # its output joins its stage tree (baseline requests' do not)
                self.engine.finish_request(req_id, keep_output=speculated)
        self._write_stats()
        return drafts

    def _count(self, stage: str, req_id: str, produced: int) -> None:
        s = self.stats.setdefault(stage, {"steps": 0, "drafted": 0, "accepted": 0, "tokens": 0})
        s["tokens"] += produced
        pending = self._last_draft.get(req_id)
        if pending is not None:  # this step verified the draft proposed last time
            s["steps"] += 1
            s["drafted"] += pending
            s["accepted"] += min(pending, produced - 1)

    def _write_stats(self) -> None:
        """Rewritten every step (a few dozen bytes): the proxy reads it whenever /metrics is scraped."""
        if not self.stats_path:
            return
        path = Path(self.stats_path)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats))
        tmp.replace(path)

    def load_model(self, *args, **kwargs) -> None:
        """No draft model to load."""
