"""Agent runs from the shared traces, as the importers read them (traces/formats), with their
true stage: the one the importer gives from the source's own agent name (OpenHands classic's
agents in its recorded integration runs and SWE-Gym trajectories; SWE-agent: one stage, though
every instance prompt differs). Tags play no part: the proxy would see none."""

from __future__ import annotations

from pathlib import Path

from agentaccel.bench.stage_sets.pipelines import LabelledCall
from agentaccel.traces.formats.registry import PARSERS, discover
from agentaccel.traces.stages import resolve_stage

CALLS_PER_SESSION = 20  # the first calls of each run: agents' prompts grow with the run, their templates do not


def imported(paths: list[Path], sessions: int, prefix: str) -> list[LabelledCall]:
    """The first `sessions` runs found under `paths` (each path in turn, so every source is in),
    their first CALLS_PER_SESSION calls each."""
    per_path = max(1, sessions // len(paths))
    out = []
    for path in paths:
        taken = 0
        for source in discover([path]):
            if source.format is None or taken >= per_path:
                continue
            for session in PARSERS[source.format](source.path):
                if taken >= per_path:
                    break
                taken += 1
                for call in session.calls[:CALLS_PER_SESSION]:
                    out.append(LabelledCall(call.messages, call.response, resolve_stage(session, call),
                                            f"{prefix}/{session.key}"))
    return out


def openhands_recorded(traces: Path, sessions: int) -> list[LabelledCall]:
    """OpenHands' recorded integration runs (CodeAct, CodeActSWE, Browsing, Planner, Manager,
    Delegator agents: one flattened prompt each) and SWE-Gym CodeAct trajectories (chat messages)."""
    root = traces / "openhands"
    return imported([root / "mock_logs", root / "swe-gym_openhands_sampled_trajectories.json"], sessions,
                    "openhands-recorded")


def swe_agent(traces: Path, sessions: int) -> list[LabelledCall]:
    """SWE-agent (one configuration) on Java issues, driven by three models."""
    runs = sorted((traces / "swe-agent").glob("20240825_SWE-agent_*"))
    return imported(runs, sessions, "swe-agent")


AGENTS = {"openhands-recorded": openhands_recorded, "swe-agent": swe_agent}
