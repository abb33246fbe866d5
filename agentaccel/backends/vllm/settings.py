"""What the vLLM plugin is told, in one place: written by whoever starts `vllm serve` (the managed
backend of `agentaccel serve`, `bench vllm`) as one environment variable, read once by the
proposer when vLLM builds it, every value checked against its field's type. (`AGENTACCEL_VLLM_PLUGIN=0`,
read here for plugin.register, keeps the plugin out altogether.)"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV = "AGENTACCEL_VLLM_SETTINGS"
DRAFTER_SKIPS = ("catch-up", "stale", "never")
SWITCH = "AGENTACCEL_VLLM_PLUGIN"  # "0": vLLM runs without the plugin (a `vllm serve` started by hand)


def plugin_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the plugin patches vLLM in this process (vLLM's plugin loader asks, in every process)."""
    return (os.environ if environ is None else environ).get(SWITCH, "1") != "0"


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
    follow_log: str | None = None  # every other server's output appended here as it joins the trees, with its times
    model_tokens: int = 0  # the hybrid (hybrid.py): passes of vLLM's model drafter a step beside the trees (0: none)
    # the hybrid on a worker alone, a step that sends no chain: "catch-up" runs no pass (the positions
    # skipped written by its next first pass, catch_up.py); "stale" runs none and leaves them
    # (what staleness costs, measured); "never" runs its first pass every step
    drafter_skip: str = "catch-up"

    def __post_init__(self) -> None:
        if self.drafter_skip not in DRAFTER_SKIPS:
            raise ValueError(f"{ENV}: drafter_skip must be one of {', '.join(DRAFTER_SKIPS)}, "
                             f"got {self.drafter_skip!r}")

    def environ(self) -> dict[str, str]:
        """The environment variable that carries these settings to vLLM's worker processes: the
        values that differ from the defaults (what a plugin of an earlier release, which refuses a
        name it does not know, reads as long as only what it knows is set: `bench vllm`'s
        agentaccel@LABEL)."""
        default = type(self)()
        return {ENV: json.dumps({f.name: getattr(self, f.name) for f in fields(self)
                                 if getattr(self, f.name) != getattr(default, f.name)})}

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
        hints = typing.get_type_hints(cls)
        wrong = [f"{name} must be {_described(hints[name])}, got {value!r}" for name, value in given.items()
                 if not _is(value, hints[name])]
        if wrong:
            raise ValueError(f"{ENV}: " + "; ".join(wrong))
        return cls(**given)


def _allowed(hint) -> tuple[type, ...]:
    """The types a field takes (`str | None` -> str, NoneType)."""
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _is(value, hint) -> bool:
    """Whether `value` is of the field's type, as JSON gives it: a bool is no int, and "false" no bool."""
    return any(value is None if t is type(None) else
               isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in _allowed(hint))


def _described(hint) -> str:
    names = {bool: "true or false", int: "an integer", str: "a string", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in _allowed(hint))
