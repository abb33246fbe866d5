"""One `vllm serve` per method, alive together while the methods take turns.

Methods: `none` (plain decoding), vLLM's `ngram` (its documented setting, and a tuned one),
vLLM's own `suffix` (ArcticInference's cache; our plugin kept out with AGENTACCEL_VLLM_PLUGIN=0),
vLLM's draft-model speculation (`drafter`, with the model `--drafter` names) and `agentaccel`
(our plugin, every call tagged with its stage); `agentaccel@LABEL` is the agentaccel method with the
plugin of another release (the folder `--source LABEL=PATH` names: the trees of two commits side by
side on the same calls). An agentaccel server starts as `agentaccel serve
--backend vllm` starts its vLLM: its trees seeded from its trace store (a copy of the history,
each agentaccel server its own), following the store for the calls recorded there, its snapshot
saved at shutdown and adopted at the next start. vLLM's methods start as vLLM does: from nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from agentaccel.backends.vllm.backend import launch_command
from agentaccel.backends.vllm.drafting import (
    DEFAULT_SPECULATIVE_CONFIG,
    PLUGIN_SPECULATIVE_CONFIG,
    hybrid_config,
    predict_layers,
)
from agentaccel.backends.vllm.settings import PluginSettings
from agentaccel.bench.vllm.releases import SOURCED, source_env
from agentaccel.processes import free_port, run_group, stop_groups

# the hybrid: our proposer with that drafter beside the trees (backends/vllm/hybrid.py), and what its
# drafter does on a step that sends no chain (settings.py's drafter_skip): as served, no pass, the
# positions caught up by the next; no pass, the positions left stale (what staleness costs); its
# first pass every step (as where it is split over workers)
HYBRIDS = {"agentaccel-drafter": "catch-up", "agentaccel-drafter-stale": "stale",
           "agentaccel-drafter-every-step": "never"}
METHODS: dict[str, dict | None] = {
    "none": None,
    # vLLM's documented example (prompt lookup 5..5 by default) and a setting tuned for agent
    # text (shorter matches, longer drafts: `bench replay` finds matches of 2-4 tokens worth it).
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "ngram-tuned": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": DEFAULT_SPECULATIVE_CONFIG,  # vLLM's built-in path over ArcticInference's cache
    "agentaccel": PLUGIN_SPECULATIVE_CONFIG,  # the same knobs, our proposer (with its own floor)
    # our proposer as it drafted before the step budget: every request sizes its own draft alone
    "agentaccel-request": PLUGIN_SPECULATIVE_CONFIG,
    # our proposer drafting nothing (every stage's longest draft 0): what speculation being on costs
    "agentaccel-off": PLUGIN_SPECULATIVE_CONFIG,
    # vLLM's draft-model speculation with the model `--drafter` names (the config: drafter_config)
    "drafter": None,
    **dict.fromkeys(HYBRIDS),  # the config: hybrid_config
}
NEEDS_DRAFTER = ("drafter", *HYBRIDS)
ARCTIC = "arctic-inference==0.3.0"
START_TIMEOUT = 900.0
START_MARK = "===== start "  # a start's first line in its server's log (each start appends)
STOP_GRACE = 10.0  # seconds a server has to stop on SIGTERM before its whole group is killed


def ours(method: str) -> bool:
    return method.startswith("agentaccel")


def known_method(method: str) -> bool:
    return method in METHODS or (method.startswith(SOURCED) and len(method) > len(SOURCED))


def drafter_config(folder: Path, tokens: int) -> dict:
    """vLLM's speculative config for the drafter in `folder`: an EAGLE head (eagle_head.py) with
    vLLM's `eagle` method, any other model with draft-model speculation."""
    from agentaccel.backends.local.eagle_head import is_eagle_head

    method = "eagle" if is_eagle_head(folder) else "draft_model"
    return {"method": method, "model": str(folder), "num_speculative_tokens": tokens}


def method_config(method: str, drafter: dict | None = None, model: str = "") -> dict | None:
    """The speculative config a method's server starts with (`drafter`: drafter_config's, for the
    drafter method; `model`: the served model, whose config an MTP drafter's is)."""
    if method in NEEDS_DRAFTER:
        if drafter is None:
            raise ValueError(f"the {method} method needs a draft model (--drafter)")
        return drafter if method == "drafter" else hybrid_config(drafter, n_predict=predict_layers(drafter, model),
                                                                 skips=HYBRIDS[method] != "never")[0]
    return METHODS["agentaccel" if method.startswith(SOURCED) else method]


def arctic_inference_path(cache: Path, echo: Callable[[str], None]) -> tuple[Path | None, str]:
    """A folder holding arctic-inference (for vLLM's own `suffix` method), built once into
    `cache` against this machine's torch (pip's isolated build would fetch another torch).
    Returns (folder, "") or (None, why it could not be had)."""
    try:
        import arctic_inference  # noqa: F401

        return Path(), ""  # already importable: nothing to add
    except ImportError:
        pass
    target = cache / ARCTIC.replace("==", "-")
    if any((target / "arctic_inference" / "suffix_decoding").glob("_C*.so")):  # built, not a failed attempt
        return target, ""
    echo(f"installing {ARCTIC} into {target} (once; builds its CPU suffix-tree extension, ~20 s)")
    # in a process group of its own, killed whole if the bench is interrupted meanwhile (pip builds in children)
    proc = run_group([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                      "--upgrade", "--target", str(target), ARCTIC], timeout=1800)
    if proc.returncode != 0:
        return None, f"pip install {ARCTIC} failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return target, ""


def method_env(method: str, arctic: Path | None, log_dir: Path | None = None, store: Path | None = None,
               drafter: dict | None = None, source: Path | None = None) -> dict:
    """What a method's server runs with. `store`: an agentaccel server's trace store (seeded from,
    followed, its snapshot beside it); None: its trees start empty and learn only from its calls.
    `drafter`: the model drafter's config (the hybrid's). `source`: the folder an agentaccel@LABEL
    server imports agentaccel from (vLLM loads the plugin by its entry point's module name: that
    folder goes first on the path, and source_first/sitecustomize.py takes an editable install's
    import hook for this checkout out of its way)."""
    env = {"AGENTACCEL_VLLM_PLUGIN": "1" if ours(method) else "0"}
    if ours(method):
        settings = PluginSettings(step_cost="off" if method == "agentaccel-request" else "",
                                  model_tokens=hybrid_config(drafter)[1] if method in HYBRIDS else 0,
                                  drafter_skip=HYBRIDS.get(method, "catch-up"))
        if store is not None:
            settings = replace(settings, db=str(store), seed=True, follow=True,
                               snapshot=str(store.with_suffix(".idx")))
        if method == "agentaccel-off":  # every stage's longest draft 0, in a file beside the server's log
            if log_dir is None:
                raise ValueError("agentaccel-off needs a folder for its drafting settings")
            off = log_dir / "spec-config-off.json"
            off.write_text('{"*": {"max_tokens": 0}}')
            settings = replace(settings, spec_config=str(off))
        if log_dir is not None:  # every step the proposer timed, and its per-stage counters: the profile
            settings = replace(settings, step_log=str(log_dir / f"steps-{method}.jsonl"),
                               stats=str(log_dir / f"stats-{method}.json"))
        env.update(settings.environ())
    if source is not None:
        env.update(source_env(source))
    elif method == "suffix" and arctic is not None and str(arctic) not in ("", "."):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(arctic), os.environ.get("PYTHONPATH", "")]))
    return env


class MethodServer:
    """A method's `vllm serve`: started, restarted (a rolling deploy), stopped; its log appended to
    `log_dir/vllm-<method>.log`."""

    def __init__(self, method: str, model: str, vllm_args: list[str], log_dir: Path, arctic: Path | None,
                 store: Path | None = None, served_name: str = "bench", drafter: dict | None = None,
                 source: Path | None = None) -> None:
        self.method, self.model, self.vllm_args, self.log_dir = method, model, vllm_args, log_dir
        # vLLM's development endpoints (VLLM_SERVER_DEV_MODE) at its next start: `reset_prefix_cache`
        # needs them; the server listens on 127.0.0.1 only
        self.dev_endpoints = False
        self.speculative, self.drafter = method_config(method, drafter, model), drafter
        self.arctic, self.store, self.served_name, self.source = arctic, store, served_name, source
        self.log_path = log_dir / f"vllm-{method}.log"
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def launch(self) -> None:
        """Starts the server (without waiting for it: `wait` does)."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv, env = launch_command(self.model, port, served_name=self.served_name, extra_args=self.vllm_args,
                                   speculative_config=self.speculative,
                                   env={**method_env(self.method, self.arctic, self.log_dir, self.store, self.drafter,
                                                   self.source),
                                        **({"VLLM_SERVER_DEV_MODE": "1"} if self.dev_endpoints else {})})
        with self.log_path.open("a") as log:
            log.write(f"\n{START_MARK}{self.starts + 1} of {self.method} at {time.strftime('%H:%M:%S')}\n")
            log.flush()
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1

    def wait(self, timeout: float = START_TIMEOUT) -> None:
        """Until the server answers (RuntimeError naming its log if it exits or times out first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.method}: vLLM exited (code {self.proc.returncode}) while starting; "
                                   f"see {self.log_path}")
            try:  # vLLM's /health answers with an empty body: the model list says it is ready
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.method}: vLLM not ready after {timeout:g} s; see {self.log_path}")

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """Empties its prefix cache (vLLM's development endpoint: `dev_endpoints`); vLLM refuses
        while blocks are still held, so it is asked again until it does it."""
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(self.url + "/reset_prefix_cache", timeout=30)
            r.raise_for_status()
            if r.json().get("success"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.method}: vLLM would not empty its prefix cache; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to its group, SIGKILL after STOP_GRACE seconds."""
        stop_servers([self])


def stop_servers(servers: list[MethodServer]) -> None:
    """Every server's whole process group stopped together, within STOP_GRACE seconds."""
    stop_groups([s.proc for s in servers if s.proc is not None], STOP_GRACE)
    for s in servers:
        s.proc = None


def start_all(servers: list[MethodServer]) -> None:
    """Launches every server, then waits for each (they load at the same time)."""
    for s in servers:
        s.launch()
    for s in servers:
        s.wait()
