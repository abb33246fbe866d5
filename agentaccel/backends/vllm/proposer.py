"""AgentaccelProposer: vLLM's suffix proposer interface, drafting from SuffixEngine.

Read once at start: vLLM's speculative config (`num_speculative_tokens` caps a draft,
`suffix_decoding_max_tree_depth` is the engine depth, `suffix_decoding_max_spec_factor` alpha —
read by the paper mode only: the default mode sizes drafts by their verification cost —,
`suffix_decoding_min_token_prob` min-prob) and the environment the managed launcher sets:

* `AGENTACCEL_DB`: the trace store; its stages' tuned drafting settings are read at start, and
  the online calibration is saved there; with `AGENTACCEL_SEED=1` it also seeds the stage trees;
* `AGENTACCEL_SPEC_CONFIG`: per-stage drafting settings (JSON, see engine.policy), winning over
  the tuned ones;
* `AGENTACCEL_ONLINE=0`: no online calibration of the stages' policies;
* `AGENTACCEL_MEMORY_BUDGET`: bytes for the global trees;
* `AGENTACCEL_VLLM_STATS`: a JSON file where a thread writes per-stage draft statistics every
  STATS_INTERVAL seconds (the proxy's /metrics reads it);
* `AGENTACCEL_DRAFT_THREADS`: drafting threads (see `_draft_threads`).

Each step drafts for the whole batch in one native call (`engine.batch.BatchDrafter`).

Each request's stage comes from `SamplingParams.extra_args["stage"]` (the proxy sends it as
`vllm_xargs.stage`); `extra_args["speculate"] = false` makes one request a baseline inside the
same server: no drafts, and its output is not learned from. vLLM verifies a chain of draft
tokens, so drafts are linear.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from agentaccel.backends.policies import policy_state, serving_policies, start_online
from agentaccel.engine import SuffixEngine
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.cost import load_profile
from agentaccel.engine.online import OnlineCalibration
from agentaccel.engine.policy import default_config

log = logging.getLogger("agentaccel.vllm")

STATS_INTERVAL = 0.5  # seconds between writes of the statistics file

# The drafter of this process's proposer: the input batch hook announces requests to it.
_DRAFTER: BatchDrafter | None = None


def _capture_stages() -> None:
    """Tells the drafter each request's stage when vLLM adds the request to the input batch (the
    proposer only sees the batch, and the batch keeps no sampling params), and when it removes
    one (finished, aborted or preempted: its tree is freed even if no step follows). compat.py
    lists both, and what else the plugin relies on."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    if getattr(InputBatch.add_request, "_agentaccel", False):
        return
    original, original_remove = InputBatch.add_request, InputBatch.remove_request

    def add_request(self, request):
        if _DRAFTER is not None:
            params = getattr(request, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            stage = extra.get("stage")
            speculate = extra.get("speculate", True) not in (False, 0, "0", "false")
            try:
                _DRAFTER.admit(request.req_id, stage if isinstance(stage, str) and stage else "default", speculate)
            except ValueError:  # a stage name the engine cannot keep: the request still runs, untagged
                _DRAFTER.admit(request.req_id, "default", speculate)
        return original(self, request)

    def remove_request(self, req_id):
        if _DRAFTER is not None:
            _DRAFTER.release(req_id)
        return original_remove(self, req_id)

    add_request._agentaccel = True
    InputBatch.add_request = add_request
    InputBatch.remove_request = remove_request


def _draft_threads() -> int:
    """`AGENTACCEL_DRAFT_THREADS`, else one on CPU (vLLM's worker already runs on every core),
    else a quarter of the cores up to 4 (a GPU host's cores are idle while the proposer runs)."""
    if os.environ.get("AGENTACCEL_DRAFT_THREADS"):
        return max(1, int(os.environ["AGENTACCEL_DRAFT_THREADS"]))
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))

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
        global _DRAFTER
        from agentaccel.backends.vllm import compat

        for problem in compat.problems():
            log.warning("agentaccel: this vLLM differs from what the plugin expects: %s", problem)
        config = vllm_config.speculative_config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        # vLLM verifies one chain, priced per token as on a GPU; the longest draft, alpha and min-prob
        # are vLLM's own settings
        base = replace(default_config(load_profile("gpu"), tree=False), max_tokens=self.num_speculative_tokens,
                       alpha=config.suffix_decoding_max_spec_factor, min_prob=config.suffix_decoding_min_token_prob)
        db = os.environ.get("AGENTACCEL_DB")
        policies, online = serving_policies(base, db=db, spec_config=os.environ.get("AGENTACCEL_SPEC_CONFIG"),
                                            say=lambda line: log.info("agentaccel: %s", line))
        budget = int(os.environ.get("AGENTACCEL_MEMORY_BUDGET", "0"))
        self.engine = SuffixEngine(max_depth=config.suffix_decoding_max_tree_depth, memory_budget_bytes=budget,
                                   config=policies.default)
        policies.install(self.engine)
        self.calibration = self.keeper = None
        if os.environ.get("AGENTACCEL_ONLINE", "1") != "0":
            self.calibration, self.keeper = start_online(self.engine, online, db)
        self.drafter = _DRAFTER = BatchDrafter(self.engine, threads=_draft_threads())
        _capture_stages()
        if os.environ.get("AGENTACCEL_SEED") == "1" and os.environ.get("AGENTACCEL_DB"):
            self._seed(vllm_config)
        if os.environ.get("AGENTACCEL_VLLM_STATS"):
            StatsWriter(self.drafter, Path(os.environ["AGENTACCEL_VLLM_STATS"]), self.calibration).start()

    def _seed(self, vllm_config) -> None:
        from agentaccel.backends.seeding import seed_from_store
        from agentaccel.text.tokenization import load_tokenizer
        from agentaccel.traces.store import TraceStore

        try:
            tokenizer = load_tokenizer(_tokenizer_file(vllm_config.model_config.tokenizer))
        except ValueError as e:
            log.warning("agentaccel: not seeding, no usable tokenizer (%s)", e)
            return
        with TraceStore(os.environ["AGENTACCEL_DB"]) as store:
            report = seed_from_store(self.engine, store, tokenizer)
        log.info("agentaccel: seeded %d outputs (%d tokens, %d stages)", report.calls, report.tokens, report.stages)

    def propose(self, num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=None) -> list[list[int]]:
        return self.drafter.step(input_batch.req_ids, input_batch.token_ids_cpu, input_batch.num_tokens_no_spec,
                                 sampled_token_ids, min(num_speculative_tokens, self.num_speculative_tokens),
                                 self.max_model_len)

    def load_model(self, *args, **kwargs) -> None:
        """No draft model to load."""


class StatsWriter(threading.Thread):
    """Writes the drafter's per-stage statistics, its live request count and the stages' policies
    to a JSON file (the proxy's /metrics and /health read it) every `interval` seconds when they
    changed: off the step's path, no file write per step. It also hands each stage's new drafted
    steps to the online calibration."""

    def __init__(self, drafter: BatchDrafter, path: Path, calibration: OnlineCalibration | None = None,
                 interval: float = STATS_INTERVAL) -> None:
        super().__init__(name="agentaccel-stats", daemon=True)
        self.drafter, self.path, self.calibration, self.interval = drafter, path, calibration, interval
        self._seen: dict[str, dict] = {}

    def run(self) -> None:
        last = None
        while True:
            time.sleep(self.interval)
            stages = self.drafter.stats()
            if self.calibration is not None:
                self._calibrate(stages)
            stats = {"stages": stages, "requests": self.drafter.tracked,
                     "pending_outputs": self.drafter.pending_outputs,
                     "policies": policy_state(self.drafter.engine, self.calibration)}
            if stats != last:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(stats))
                tmp.replace(self.path)
                last = stats

    def _calibrate(self, stages: dict[str, dict]) -> None:
        for stage, now in stages.items():
            before = self._seen.get(stage, {})
            delta = {k: now[k] - before.get(k, 0) for k in ("steps", "drafted", "accepted", "predicted")}
            self._seen[stage] = now
            if stage != "other" and delta["steps"] > 0:
                self.calibration.observe(stage, delta["predicted"], delta["accepted"], int(delta["drafted"]),
                                         steps=int(delta["steps"]))
