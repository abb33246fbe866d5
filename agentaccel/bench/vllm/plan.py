"""Which of a workload's jobs run where, and what the run is.

A workload's jobs, in order, are laid out as: the history (earlier sessions, generated once by
plain decoding into the trace store agentaccel's servers start from), then, from the first
session the history does not touch on, the warm-up (the same for every method, not measured) and
the measured blocks: for each level of requests in flight, `reps` blocks of fresh jobs, each
block run by every method in turn. So no measured call, nor any call of its session, is in the
history, and the history came before it, as yesterday's runs come before today's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.bench.vllm.releases import Release
from agentaccel.bench.vllm.sources import Job, Sources


@dataclass
class Sizes:
    """How many jobs each workload runs."""

    history: int = 0  # jobs of earlier sessions in the history (0: none, the trees start empty)
    warm: int = 1  # warm-up jobs, run by every method before the measured blocks
    per_level: dict[int, int] = field(default_factory=lambda: {1: 2, 8: 8, 16: 16})  # jobs per block
    reps: int = 3  # blocks per level (each method runs each block)

    @property
    def measured(self) -> int:
        return self.reps * sum(self.per_level.values())


def auto_jobs(level: int) -> int:
    """Jobs per block by default: at least two, and enough to keep `level` in flight."""
    return max(2, level)


@dataclass
class Layout:
    """A workload's jobs by role (indices into its job list)."""

    history: list[int]
    warm: list[int]
    blocks: dict[tuple[int, int], list[int]]  # (level, rep) -> its jobs
    reused: dict[int, int]  # level -> jobs of it that ran in an earlier block (the source ran out)

    @classmethod
    def of(cls, jobs: list[Job], sizes: Sizes) -> Layout:
        """The history takes what it asks for only while the warm-up and every level keep jobs of
        their own: a small source (the bundled recordings) gives the history less, never the
        measurement nothing."""
        reserve = sizes.warm + len(sizes.per_level)
        size = min(sizes.history, max(len(jobs) - 1, 0))
        while size and len(jobs) - _first_after(jobs, size) < reserve:
            size -= 1
        history = list(range(size))
        rest = list(range(_first_after(jobs, size), len(jobs)))
        warm = rest[: min(sizes.warm, max(len(rest) - 1, 0))]
        measured = rest[len(warm):]
        fresh = iter(measured)
        cycle = 0
        blocks: dict[tuple[int, int], list[int]] = {}
        reused: dict[int, int] = {}
        for level, count in sizes.per_level.items():
            for rep in range(sizes.reps):
                chosen = []
                for _ in range(count):
                    nxt = next(fresh, None)
                    if nxt is None:  # out of fresh jobs: the ones run in earlier blocks, in order
                        if not measured:
                            break
                        nxt = measured[cycle % len(measured)]
                        cycle += 1
                        reused[level] = reused.get(level, 0) + 1
                    chosen.append(nxt)
                blocks[(level, rep)] = chosen
        return cls(history, warm, blocks, reused)

    def notes(self, workload: str, available: int, sizes: Sizes) -> list[str]:
        out = [f"{workload} at {level} in flight: {n} of its {sizes.reps * sizes.per_level[level]} jobs ran "
               f"before in an earlier block (the source has {available}); the suffix methods' trees hold their "
               "outputs, which flatters them there" for level, n in self.reused.items()]
        if len(self.history) < sizes.history:
            out.append(f"{workload}: history cut to {len(self.history)} jobs (asked {sizes.history}): the source has "
                       f"{available}, and the warm-up and every level need jobs of their own")
        return out

    @property
    def measures(self) -> bool:
        """Whether any block has a job to measure."""
        return any(self.blocks.values())


def _first_after(jobs: list[Job], history: int) -> int:
    """The first job after a history of `history` jobs whose session the history does not touch
    (the history's last session is not measured)."""
    seen = {jobs[i].session for i in range(history)}
    start = history
    while start < len(jobs) and jobs[start].session in seen:
        start += 1
    return start


@dataclass
class Plan:
    model: str
    sources: Sources
    methods: list[str]
    workloads: list[str]
    levels: list[int]
    sizes: Sizes
    max_tokens: int  # the longest output of an agent call (its recorded length, up to this)
    keep_prompt: int  # prompts keep their last this many tokens
    vllm_args: list[str]
    log_dir: Path
    open_tokens: int = 96  # the longest output of a call with no recorded reply (SQL pipeline stages, chat)
    restart: bool = False  # every server restarts half way through each level
    cache: Path | None = None  # where a history made once is kept for the next runs (None: not kept)
    drafter: dict | None = None  # the drafter method's speculative config (servers.drafter_config)
    plugin_sources: dict[str, Release] = field(default_factory=dict)  # agentaccel@LABEL -> the release it serves with

    @property
    def restart_before(self) -> int:
        """The rep before which the servers restart (restart mode): half way through the level."""
        return max(1, self.sizes.reps // 2)
