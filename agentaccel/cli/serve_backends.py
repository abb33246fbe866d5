"""The backend `agentaccel serve` runs, built from its options (cli/serve_options.ServeOptions), and
the stage trees' start from the trace store that the embedded and replay backends share."""

from __future__ import annotations

import atexit

from agentaccel.cli.common import cost_spec, err, fail, open_store, open_tokenizer
from agentaccel.cli.serve_options import BackendKind, ServeOptions


def build_backend(options: ServeOptions, vllm_args: list[str], recorder):
    """The backend the options name; `vllm_args`: what followed `--` on the command line."""
    if options.backend is BackendKind.openai:
        from agentaccel.backends.openai_compat import OpenAIBackend

        return OpenAIBackend(options.upstream, api_key=options.upstream_api_key, timeout=options.upstream_timeout,
                             session_header=options.session_header or None)
    if options.backend is BackendKind.local:
        return _local_backend(options, recorder)
    if options.backend is BackendKind.replay:
        return _replay_backend(options, recorder)
    from agentaccel.backends.vllm.backend import VLLMBackend

    return VLLMBackend(vllm_settings(options, vllm_args))


def vllm_settings(options: ServeOptions, vllm_args: list[str]):
    """What the managed vLLM server is asked to be (backends/vllm/backend.VLLMSettings)."""
    from agentaccel.backends.vllm.backend import VLLMSettings

    model, served = options.model, options.served_model_name
    if not model:  # the bundled model, as the embedded backend serves it
        model, served = _bundled_model(), served or "SmolLM2-135M-Instruct"
    return VLLMSettings(
        model=model, served_name=served, extra_args=tuple(vllm_args), db=options.location, seed=options.seed,
        follow=options.follow, scoped=options.scoped, online=options.online_tuning, record=options.record,
        snapshot=options.snapshot, spec_config=options.spec_config,
        memory_budget_bytes=options.memory_budget_bytes, step_cost=options.cost_profile,
        follow_log=options.follow_log, drafter=options.model_drafter, timeout=options.upstream_timeout,
        session_header=options.session_header or None)


def _say(line: str) -> None:
    err.print(f"agentaccel: {line}", highlight=False, markup=False)


def _local_backend(options: ServeOptions, recorder):
    from agentaccel.backends.local.service import LocalBackend
    from agentaccel.cli.common import parse_size
    from agentaccel.engine import SuffixEngine

    engine = SuffixEngine(memory_budget_bytes=options.memory_budget_bytes)

    def on_ready(engine, tokenizer):
        if recorder is not None:
            recorder.set_tokenizer((tokenizer.fingerprint, tokenizer.encode_batch))
        return _trees_from_store(engine, tokenizer, options)

    return LocalBackend(engine, model_path=options.model, device=options.device, dtype=options.dtype.value,
                        served_name=options.served_model_name, spec_config=options.spec_config,
                        policy_db=options.location, online=options.online_tuning,
                        save_calibration=recorder is not None, on_ready=on_ready,
                        cost_profile=options.cost_profile, prefix_cache_bytes=parse_size(options.prefix_cache),
                        say=_say)


def _replay_backend(options: ServeOptions, recorder):
    from agentaccel.backends.policies import resume_online, serving_policies
    from agentaccel.backends.replay import ReplayBackend
    from agentaccel.engine import SuffixEngine
    from agentaccel.engine.policy import default_config

    db = options.answers or options.location
    profile = cost_spec("gpu" if options.cost_profile == "auto" else options.cost_profile, "--cost-profile", db)
    store = open_store(db, must_exist=True)
    tokenizer = open_tokenizer(None)  # the recordings' and, with --recordings, the trees' and the recorder's
    engine = SuffixEngine(memory_budget_bytes=options.memory_budget_bytes)
    # the recordings' store also holds tuned policies; a replay does not save its calibration back
    policies, resumed = serving_policies(default_config(profile), db=store.location, spec_config=options.spec_config,
                                         say=_say)
    policies.install(engine)
    calibration = resume_online(engine, resumed) if options.online_tuning else None
    with store:
        backend = ReplayBackend(store, tokenizer, profile, step_ms=options.step_ms,
                                speculate=options.speculation, served_name=options.served_model_name or "replay",
                                engine=engine, online=calibration, context=options.context_window)
    if not len(backend.recordings):
        raise fail(f"{store.name} holds no recorded calls to replay")
    err.print(f"agentaccel: replaying {len(backend.recordings)} recorded sessions from {store.name}; a plain step "
              f"takes {options.step_ms:g} ms, a verifying one {profile.name}'s cost (simulated); speculation "
              f"{'on' if options.speculation else 'off'}")
    if options.answers is not None:  # --db is this server's own store, as a real server's
        if recorder is not None:
            recorder.set_tokenizer((tokenizer.fingerprint, tokenizer.encode_batch))
        backend.follower = _trees_from_store(engine, tokenizer, options)
    return backend


def _bundled_model() -> str:
    """The default model's folder (made from the bundled GGUF on first use), or a CLI error."""
    from agentaccel.assets import MissingAsset

    try:
        from agentaccel.backends.local.model import default_model_folder

        return str(default_model_folder())
    except (MissingAsset, ImportError) as e:
        raise fail(f"no --model given and no bundled model to serve: {e}") from e


def _trees_from_store(engine, tokenizer, options: ServeOptions):
    """The stage trees seeded from the trace store (`--seed`, with a progress bar, from `--snapshot`
    where one covers it), then (`--follow`) adding every call any server records there while this one
    serves, each tenant's to its own trees when scoped; returns the follower (None: not following)."""
    from rich.progress import Progress

    from agentaccel.backends.follower import StoreFollower, seed_then_follow

    db, snapshot, follower = options.location, options.snapshot, None
    if options.seed:
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task("seeding stage trees from the trace store", total=None)
            report, follower = seed_then_follow(
                engine, db, tokenizer, follow=options.follow, snapshot=snapshot, scoped=options.scoped,
                log_path=options.follow_log, progress=lambda done, total: progress.update(task, completed=done,
                                                                                           total=total))
        if report.snapshot is not None:
            err.print(f"agentaccel: stage trees from the snapshot {snapshot} (calls up to {report.snapshot.cursor}), "
                      f"then the {report.after_snapshot} outputs recorded after it in {db}"
                      + (f" ({report.after_snapshot_later} more are read as it first drafts for their stages)"
                         if report.after_snapshot_later else ""))
        else:
            if snapshot is not None:
                err.print(f"agentaccel: snapshot not used: {report.snapshot_refused}", markup=False, highlight=False)
            err.print(f"agentaccel: seeded {report.calls} outputs ({report.tokens} tokens, {report.stages} stages) "
                      f"from {db}")
    elif options.follow:
        follower = StoreFollower(engine, db, tokenizer, scoped=options.scoped, log_path=options.follow_log).start()
    if follower is not None:
        atexit.register(follower.close)
        err.print(f"agentaccel: learning from every call recorded into {db} from now on")
    return follower
