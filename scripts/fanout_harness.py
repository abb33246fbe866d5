"""What the two fan-out benchmarks share (scripts/bench_store_fanout.py: followers tailing one
PostgreSQL store; scripts/bench_broker_fanout.py: subscribers of one NATS server): writers paced
in 50 ms batches, a fleet's processes started and stopped, a level written for a while, and the
`plot NAME=RUN.json ... OUT.png` form of their command lines."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

BATCH_SECONDS = 0.05  # a recorder commits (and would publish) what it holds this often


class Pace:
    """How many calls a writer owes at its rate since its last batch, and how long to rest after one."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.owed, self.last = 0.0, time.monotonic()

    def due(self, rate: float) -> int:
        """Calls owed now (the batch begins)."""
        now = time.monotonic()
        self.owed += rate * (now - self.last)
        self.last = now
        n = int(self.owed)
        self.owed -= n
        return n

    def rest(self) -> float:
        """Seconds left of the batch begun at the last `due`."""
        return max(0.0, BATCH_SECONDS - (time.monotonic() - self.last))


def wait_started(procs: Sequence, ready, idle, timeout: float, what: str) -> None:
    """Until every reader says it is ready and every writer idle; RuntimeError if a process dies or
    `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while not (all(ready) and all(idle)):
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
            raise RuntimeError(f"{sum(ready)} of {len(ready)} {what} and {sum(idle)} of {len(idle)} writers started")
        time.sleep(0.05)


def write_for(seconds: float, per_writer: float, rate, writing, idle) -> float:
    """The writers at `per_writer` calls/s each for `seconds`; returns how long they wrote, the last
    batch included."""
    rate.value = per_writer
    t0 = time.monotonic()
    writing.set()
    time.sleep(seconds)
    writing.clear()
    while not all(idle):
        time.sleep(0.005)
    return time.monotonic() - t0


def stop_all(stop, writing, procs: Sequence) -> None:
    stop.set()
    writing.clear()
    for p in procs:
        p.join(15)
        if p.is_alive():
            p.kill()


def plot_command(argv: Sequence[str], plot: Callable[[dict[str, list[dict]], Path], None]) -> bool:
    """`plot NAME=RUN.json ... OUT.png`: several runs' --json side by side; False for any other command line."""
    if list(argv[:1]) != ["plot"]:
        return False
    *named, out = argv[1:]
    plot({name: json.loads(Path(run).read_text())["rows"] for name, run in (n.split("=", 1) for n in named)},
         Path(out))
    return True


def label_axes(labelled: Sequence[tuple[object, str]], xlabel: str, title: str, *, log_y: bool = False) -> None:
    """Each (matplotlib axes, y label): x on a log scale, a title, a legend."""
    for ax, label in labelled:
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)


def save_figure(fig, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
