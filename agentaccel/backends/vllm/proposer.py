"""AgentaccelProposer: vLLM's suffix proposer interface, drafting from SuffixEngine.

Read once at start: vLLM's speculative config (`num_speculative_tokens` caps a draft,
`suffix_decoding_max_tree_depth` is the engine depth, `suffix_decoding_max_spec_factor` alpha —
read by the paper mode only: the default mode sizes drafts by their verification cost —,
`suffix_decoding_min_token_prob` min-prob) and the settings its starter wrote (settings.py,
`PluginSettings`: the trace store and what to do with it, the statistics file, how each step's
drafts are sized). The step cost: unless `step_cost` is "off" (every request sizes its own draft
alone, as before the budget), one budget for the whole batch under a step cost learned from this
server's own steps, starting from the curve the trace store kept for this server, else `step_cost`
when it is a cost spec, else the calibrated roofline of the model on this GPU, else the GPU or CPU
seed (engine/cost).

Each step drafts for the whole batch in one native call (`engine.batch.BatchDrafter`).

Each request's stage comes from `SamplingParams.extra_args["stage"]` (the proxy sends it as
`vllm_xargs.stage`), its tenant's scope from `extra_args["scope"]` (set by the proxy alone);
`extra_args["speculate"] = false` makes one request a baseline inside the same server: no
drafts, and its output is not learned from (nor, recorded by the proxy, by any server: the store's
`baseline_calls`). A seeded sampled request is not drafted for either (`seeded_sampling`): its
output repeats. vLLM verifies a chain of draft tokens, so drafts are linear.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.util
import os
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from agentaccel.backends import model_records
from agentaccel.backends.base import step_cost_state
from agentaccel.backends.policies import CounterCalibration, policy_state, serving_policies, start_online
from agentaccel.backends.step_costs import LearnedStepCost, stored_curves
from agentaccel.backends.vllm import stats_files
from agentaccel.backends.vllm.drafting import plugin_drafting
from agentaccel.backends.vllm.settings import PluginSettings
from agentaccel.backends.vllm.workers import WorkerPlace, this_worker
from agentaccel.engine import SuffixEngine
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.cost import StepCostModel, parse, roofline, seed
from agentaccel.engine.cost.drafter_pass import DrafterPassShare
from agentaccel.engine.online import OnlineCalibration
from agentaccel.traces.database import locate


class _RankLog(logging.LoggerAdapter):
    """Every line names the worker it comes from: with tensor or data parallelism several write."""

    def process(self, msg, kwargs):
        return f"[{self.extra['rank']}] {msg}", kwargs


log = _RankLog(logging.getLogger("agentaccel.vllm"), {"rank": "rank ?"})

STATS_INTERVAL = 0.5  # seconds between writes of the statistics file

# The drafter of this process's proposer: the input batch hook announces requests to it.
_DRAFTER: BatchDrafter | None = None
# Tokens the step that just ran computed (its scheduler output), set by the model runner hook
# right before it calls propose.
_SCHEDULED = -1


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
            stage = stage if isinstance(stage, str) and stage else "default"
            scope = extra.get("scope")  # the tenant whose trees it drafts from (set by the proxy)
            # the proxy lets only true or false through (proxy/validation.py), which vLLM's
            # vllm_xargs (str | int | float values) hands over as 0 / 1; a seeded sampled request must
            # repeat, and drafts would change its random draws: it is not drafted for
            speculate = extra.get("speculate", True) not in (False, 0, "0", "false") and not seeded_sampling(params)
            max_tokens = getattr(params, "max_tokens", None)
            prompt = getattr(request, "num_prompt_tokens", None)
            limit = prompt + max_tokens if isinstance(max_tokens, int) and isinstance(prompt, int) else None
            scope = scope if isinstance(scope, str) and scope else None
            try:
                _DRAFTER.admit(request.req_id, stage, speculate, limit, scope)
            except ValueError:  # a stage name the engine cannot keep: the request still runs, untagged
                try:
                    _DRAFTER.admit(request.req_id, "default", speculate, limit, scope)
                except ValueError:  # nor its scope: it runs without drafts, and nothing learns its output
                    _DRAFTER.admit(request.req_id, "default", False, limit)
        return original(self, request)

    def remove_request(self, req_id):
        if _DRAFTER is not None:
            _DRAFTER.release(req_id)
        return original_remove(self, req_id)

    add_request._agentaccel = True
    InputBatch.add_request = add_request
    InputBatch.remove_request = remove_request


def seeded_sampling(params) -> bool:
    """Sampled with a seed (vLLM's RANDOM_SEED): the same request must give the same output. vLLM's
    rejection sampler draws per draft token, and our drafts depend on every other request's
    output: drafted for, the request would not repeat (docs/SERVING.md, "What repeats")."""
    seed, temperature = getattr(params, "seed", None), getattr(params, "temperature", 0.0)
    return seed is not None and isinstance(temperature, int | float) and temperature >= 1e-5


def _capture_scheduled() -> None:
    """Hands the proposer the tokens each step computed (prefill chunks included: the step cost
    model is fitted to them), from the scheduler output the model runner drafts with."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.propose_draft_token_ids, "_agentaccel", False):
        return
    original = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        global _SCHEDULED
        _SCHEDULED = int(getattr(scheduler_output, "total_num_scheduled_tokens", -1))
        return original(self, scheduler_output, *args, **kwargs)

    propose_draft_token_ids._agentaccel = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


def _fit_drafts_per_request(model_passes: int) -> None:
    """vLLM runs the drafter for a step only if its longest request plus num_speculative_tokens
    fits the model: with our 32, a whole batch drafts nothing once any one request is within 33
    tokens of max_model_len. The trees' drafts are cut per request to its own room (BatchDrafter),
    and vLLM's EAGLE clamps a row's positions past the end, so only the model drafter's passes need
    the room: `model_passes` (the hybrid's model_tokens), none for the trees alone."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._input_fits_in_drafter, "_agentaccel", False):
        return

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        if common_attn_metadata is None:
            return False
        return common_attn_metadata.max_seq_len + model_passes <= self.effective_drafter_max_model_len

    _input_fits_in_drafter._agentaccel = True
    GPUModelRunner._input_fits_in_drafter = _input_fits_in_drafter


def _draft_threads(given: int) -> int:
    """`given` (the settings' draft_threads), else one on CPU (vLLM's worker already runs on every
    core), else a quarter of the cores up to 4 (a GPU host's cores are idle while the proposer runs)."""
    if given > 0:
        return given
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


def rank_label(vllm_config, place: WorkerPlace) -> str:
    """dp<data-parallel rank> tp<tensor-parallel rank> (what log lines and statistics files carry)."""
    return f"dp{data_parallel_rank(vllm_config)} tp{place.tensor_rank}"


def data_parallel_rank(vllm_config) -> int:
    """This engine's data-parallel rank. vLLM runs the ranks of a dense model as independent
    engines (data_parallel_rank 0 in each); data_parallel_index keeps the real rank."""
    parallel = vllm_config.parallel_config
    return getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)


def at_exit(close) -> None:
    """`close` when this worker exits cleanly. vLLM's workers are multiprocessing children, which
    leave through os._exit (no atexit handlers run): multiprocessing's own finalizers do run there,
    and in a main process at interpreter exit."""
    multiprocessing.util.Finalize(None, close, exitpriority=10)


def server_key(vllm_config) -> str:
    """What a learned step cost belongs to: the model, the device, tensor parallelism."""
    from vllm.platforms import current_platform

    device = "cpu"
    if not current_platform.is_cpu():
        import torch

        device = torch.cuda.get_device_name().replace(" ", "-")
    model = Path(str(vllm_config.model_config.model)).name
    return f"{model}|{device}|tp{vllm_config.parallel_config.tensor_parallel_size}"


def seed_cost(vllm_config, mode: str, db: str | None = None) -> tuple[StepCostModel, bool]:
    """Where the step cost starts before this server's steps say more (`mode`: the settings'
    step_cost), and whether it prices in seconds (a relative seed does not: 1.0 is a plain step)."""
    if mode:
        server = parse(mode, learned=stored_curves(db))
        return server.model, not server.relative
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return seed("cpu"), False
    import torch

    found = roofline.from_config(vllm_config.model_config.hf_config, torch.cuda.get_device_name(),
                                 vllm_config.parallel_config.tensor_parallel_size)
    return (found.model_cost(), True) if found is not None else (seed("gpu"), False)


class AgentaccelProposer:
    def __init__(self, vllm_config) -> None:
        global _DRAFTER
        from agentaccel.backends.vllm import compat

        place = this_worker()
        log.extra["rank"] = rank_label(vllm_config, place)
        config = vllm_config.speculative_config
        drafting = plugin_drafting(config)
        self.num_speculative_tokens = drafting.max_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.drafts = place.drafts_taken
        # in every worker, drafting or not: split over workers, all run the drafter's passes or none
        _fit_drafts_per_request(PluginSettings.from_environ().model_tokens)
        if not self.drafts:  # no trees, follower, calibration, learning or statistics: nothing it did would count
            log.info("agentaccel: vLLM takes its drafts from another worker; this one drafts nothing")
            return
        for problem in compat.problems():
            log.warning("agentaccel: this vLLM differs from what the plugin expects: %s", problem)
        self.settings = settings = PluginSettings.from_environ()
        db = settings.db
        policies, online = serving_policies(drafting.config, db=db, spec_config=settings.spec_config,
                                            say=lambda line: log.info("agentaccel: %s", line))
        self.engine = SuffixEngine(max_depth=drafting.depth, memory_budget_bytes=settings.memory_budget,
                                   config=policies.default)
        policies.install(self.engine)
        # before the drafter is built on the engine: a snapshot replaces the engine's trees
        self.follower = None
        self.seeded: dict[str, dict[str, int]] = {}  # per stage: documents and tokens the trees started with
        if (settings.seed or settings.follow) and db:
            self._seed(vllm_config, settings)
        self.drafter = _DRAFTER = BatchDrafter(self.engine, threads=_draft_threads(settings.draft_threads))
        self.calibration = self.keeper = self.model_keeper = None
        if settings.model_tokens > 0:  # the hybrid: what the model drafter got per stage, kept in the store
            key = model_records.drafter_key(str(config.model), str(vllm_config.model_config.model))
            found = model_records.resume(self.drafter, db, key)
            log.info("agentaccel: the model drafter beside the trees (%s): %d stages' records from the store",
                     key, found)
            if db and settings.save:
                self.model_keeper = model_records.ModelRecordKeeper(self.drafter, db, key)
            self.pass_share = DrafterPassShare()
        self.skipping = DrafterSkipping()  # the hybrid's steps run and skipped, and the catch-up's counts
        if settings.online:  # --no-record: calibrated in memory, never saved
            self.calibration, self.keeper = start_online(self.engine, online, db if settings.save else None)
            CounterCalibration(self.drafter, self.calibration, STATS_INTERVAL).start()
        _capture_stages()
        self.step_cost = None
        if settings.step_cost != "off":
            _capture_scheduled()
            start, in_seconds = seed_cost(vllm_config, settings.step_cost, db)
            self.step_cost = LearnedStepCost.starting(
                server_key(vllm_config), db, start, seed_in_seconds=in_seconds, save=settings.save,
                say=lambda line: log.info("agentaccel: one draft budget per step; %s", line),
                apply=self.drafter.set_step_cost, drain=self.drafter.drain_timings, every=STATS_INTERVAL,
                step_log=Path(settings.step_log) if settings.step_log else None)
        for keeper in (self.keeper, self.step_cost, self.model_keeper):  # learned since the last save, at exit
            if keeper is not None:
                at_exit(keeper.close)
        if settings.stats:  # each data-parallel rank writes a file of its own
            path = stats_files.rank_path(Path(settings.stats), data_parallel_rank(vllm_config), place.tensor_rank)
            StatsWriter(self.drafter, path, self.calibration, self.step_cost, self.follower, self.seeded, self.skipping,
                        worker=log.extra["rank"]).start()

    def _seed(self, vllm_config, settings: PluginSettings) -> None:
        from agentaccel.backends.follower import StoreFollower, seed_then_follow
        from agentaccel.text.tokenization import load_tokenizer

        try:
            tokenizer = load_tokenizer(_tokenizer_file(vllm_config.model_config.tokenizer))
        except ValueError as e:
            log.warning("agentaccel: not seeding, no usable tokenizer (%s)", e)
            return
        db, scoped = settings.db, settings.scoped
        if settings.seed:
            # every data-parallel rank learns the same calls: rank 0 alone keeps the snapshot
            snapshot = settings.snapshot
            report, self.follower = seed_then_follow(self.engine, db, tokenizer, follow=settings.follow,
                                                     snapshot=snapshot,
                                                     save_snapshot=data_parallel_rank(vllm_config) == 0,
                                                     scoped=scoped, log_path=settings.follow_log)
            # what the trees hold before the first request, by stage: shown in /metrics (agentaccel_seeded_*)
            self.seeded = {stage: {"documents": s["documents"], "tokens": s["tokens"]}
                           for stage, s in self.engine.stats()["stages"].items() if s["documents"]}
            where = (f"the snapshot {snapshot} (calls up to {report.snapshot.cursor}), then {report.after_snapshot} "
                     f"recorded after it in the store ({report.after_snapshot_later} more as it first drafts for "
                     "their stages)"
                     if report.snapshot is not None else "the trace store")
            log.info("agentaccel: seeded %d outputs (%d tokens) in %d stages from %s %s: %s", sum(
                s["documents"] for s in self.seeded.values()), sum(s["tokens"] for s in self.seeded.values()),
                len(self.seeded), where, locate(db), ", ".join(
                    f"{stage} {s['documents']}" for stage, s in sorted(self.seeded.items())[:12]) or "nothing")
        else:
            self.follower = StoreFollower(self.engine, db, tokenizer, scoped=scoped,
                                          log_path=settings.follow_log).start()
        if self.follower is not None:
            at_exit(self.follower.close)

    def propose(self, num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=None,
                model_chains: list[list[int]] | int | None = None) -> list[list[int]]:
        """`model_chains`: the hybrid's model chains, one per row, or their length: the rows sent one hold
        placeholders until the drafter fills them (hybrid.py)."""
        if not self.drafts:
            return [[] for _ in input_batch.req_ids]
        return self.drafter.step(input_batch.req_ids, input_batch.token_ids_cpu, input_batch.num_tokens_no_spec,
                                 sampled_token_ids, min(num_speculative_tokens, self.num_speculative_tokens),
                                 self.max_model_len, _SCHEDULED, model_chains)

    def model_rows(self) -> list[bool]:
        """The last step's rows sent the model's chain (the hybrid)."""
        return self.drafter.model_rows() if self.drafts else []

    def followed_rows(self) -> list[bool]:
        """The last step's rows whose request the model drafter follows (the hybrid)."""
        return self.drafter.followed_rows() if self.drafts else []

    def model_passes(self) -> int:
        """The last step's longest model chain sent (the hybrid)."""
        return self.drafter.model_passes() if self.drafts else 0

    def drafter_skips(self, skips: bool) -> None:
        """The hybrid's drafter runs no pass on a step that sends no chain (hybrid.py): its first
        pass is then a choice the budget prices, as it does the passes after it, and it follows
        only some of a cold stage's requests (BatchDrafter.followed_rows)."""
        if self.drafts:
            self.skipping.skips = skips
            self.drafter.set_drafter_skips(skips)

    def drafter_ran(self, passes: int, seconds: float, input_batch, sampled_token_ids, chosen: bool = True) -> None:
        """The hybrid's model drafter ran `passes` (0: none, the step skipped it) for this step's
        batch in `seconds`: the next step's timing counts them apart from the target's step (which
        the step cost is learned from), and once the step cost is in seconds the budget prices its
        passes at the shares of the batch's plain step they took (engine/cost/drafter_pass.py): the
        first one too where a step may skip it. A call not `chosen` (run although no chain was
        sent) is timed but does not price a pass."""
        if not self.drafts:
            return
        self.drafter.drafter_ran(passes, seconds)
        self.skipping.steps[bool(passes)] += 1
        cost = self.drafter.step_cost  # None until learned in seconds
        rows = sum(1 for tokens in sampled_token_ids if len(tokens))
        if cost is None or not rows or not passes or not chosen:
            return
        n = len(sampled_token_ids)
        context = float(input_batch.num_tokens_no_spec[:n].sum())
        self.pass_share.observe(passes, seconds, float(cost.seconds(rows, context, context, rows)))
        learned = self.pass_share.priced
        if learned is not None:
            # a first pass that runs every step is no choice: unpriced
            self.drafter.drafter_pass_cost = learned if self.skipping.skips else replace(learned, first=0.0)

    def load_model(self, *args, **kwargs) -> None:
        """No draft model to load."""


class DrafterSkipping:
    """The hybrid's model drafter: the steps it ran and skipped (hybrid.py), and what the catch-up
    (catch_up.py, where it runs) wrote late and left stale, in tokens."""

    def __init__(self) -> None:
        self.skips = False  # a step that sends no chain runs no pass (hybrid.py says)
        self.steps = [0, 0]  # [skipped, ran]
        self.catch_up = None

    def state(self) -> dict:
        state = {"drafter_steps_run": self.steps[1], "drafter_steps_skipped": self.steps[0]}
        if self.catch_up is not None:
            state.update(caught_up_tokens=self.catch_up.caught_up_tokens, stale_tokens=self.catch_up.dropped_tokens)
        return state


class StatsWriter(threading.Thread):
    """Every `interval` seconds, off the step's path: writes the drafter's per-stage statistics, its
    live request count, the stages' policies and the step cost to a JSON file when they changed (the
    proxy's /metrics and /health read it; no file write per step). It only reads: the calibration
    is fed by its own thread (CounterCalibration), the step cost learned by its own service
    (backends/step_costs.py)."""

    def __init__(self, drafter: BatchDrafter, path: Path, calibration: OnlineCalibration | None = None,
                 step_cost: LearnedStepCost | None = None, follower=None, seeded: dict | None = None,
                 skipping: DrafterSkipping | None = None, interval: float = STATS_INTERVAL,
                 worker: str = "dp0 tp0") -> None:
        super().__init__(name="agentaccel-stats", daemon=True)
        self.drafter, self.path, self.calibration, self.interval = drafter, path, calibration, interval
        self.step_cost, self.follower, self.seeded, self.worker = step_cost, follower, seeded or {}, worker
        self.skipping = skipping

    def run(self) -> None:
        last = None
        while True:
            time.sleep(self.interval)
            stats = {"worker": self.worker, "stages": self.drafter.stats(), "requests": self.drafter.tracked,
                     "pending_outputs": self.drafter.pending_outputs,
                     "policies": policy_state(self.drafter.engine, self.calibration),
                     "drafter": self._drafter_state()}
            if self.follower is not None:
                stats["follower"] = asdict(self.follower.stats)
            if self.seeded:
                stats["seeded"] = self.seeded
            if stats != last:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(stats))
                tmp.replace(self.path)
                last = stats

    def _drafter_state(self) -> dict:
        """The proposer's own time, and the step cost it drafts under (seconds of a step computing
        that many tokens, without context)."""
        state = {"proposer_seconds": self.drafter.proposer_seconds, "steps": self.drafter.steps}
        priced = self.drafter.drafter_pass_cost
        if priced:  # the hybrid, once its passes are priced
            state["drafter_pass_cost"] = {"first": priced.first, "further": priced.further}
        if self.skipping is not None and any(self.skipping.steps):  # the hybrid's
            state.update(self.skipping.state())
            state["model_stages"] = model_records.following(self.drafter)
        cost = self.drafter.step_cost  # the learner's latest fit, once it prices in seconds
        if cost is not None:
            state.update(step_cost_state(cost, self.step_cost.steps if self.step_cost is not None else 0))
        return state
