"""What the vLLM plugin is told, in one place: written by whoever starts `vllm serve` (the managed
backend of `agentaccel serve`, `bench vllm`) as one environment variable, read once by the
proposer when vLLM builds it. (`AGENTACCEL_VLLM_PLUGIN=0`, read by plugin.register, keeps the
plugin out altogether.)"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

ENV = "AGENTACCEL_VLLM_SETTINGS"


@dataclass(frozen=True)
class PluginSettings:
    db: str | None = None  # the trace store: tuned policies, kept calibration and step cost (None: none)
    seed: bool = False  # seed the stage trees from the store's recorded outputs at start
    follow: bool = False  # then add every call any server records there (its follower)
    scoped: bool = False  # a tenant's recorded answers join its own trees (serve --speculation-scope key)
    snapshot: str | None = None  # trees saved here with the store cursor they cover, and adopted at start
    spec_config: str | None = None  # per-stage drafting settings (JSON, engine/policy.py), over the tuned ones
    online: bool = True  # calibrate each stage's policy to what its drafts get accepted
    save: bool = True  # keep what it learns (calibration, step cost) in the store; False (--no-record): nothing
    memory_budget: int = 0  # bytes for the global trees (0: unbounded)
    step_cost: str = ""  # "": one budget per step, its step cost learned; "off": each request alone; or a cost spec
    stats: str | None = None  # JSON file of per-stage statistics the proxy's /metrics and /health read
    step_log: str | None = None  # every timed step appended here as a JSON line (bench vllm's simulator)
    draft_threads: int = 0  # drafting threads (0: one on CPU, up to four on a GPU host)

    def environ(self) -> dict[str, str]:
        """The environment variable that carries these settings to vLLM's worker processes."""
        return {ENV: json.dumps(asdict(self))}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> PluginSettings:
        """The settings a starter wrote (defaults when none: a `vllm serve` started by hand drafts
        with empty trees and learns its step cost in memory). A malformed value is an error: a
        server must not run on settings other than the ones it was given."""
        text = (os.environ if environ is None else environ).get(ENV)
        if not text:
            return cls()
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV} is not JSON: {e}") from e
        known = {f.name for f in fields(cls)}
        if not isinstance(given, dict) or set(given) - known:
            raise ValueError(f"{ENV} must be an object of {sorted(known)}, got {text[:200]!r}")
        return cls(**given)
