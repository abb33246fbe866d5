"""The step-cost learner of this tree beside those of earlier commits, on a kept `bench vllm` run:
how far each one's price of a draft token lands from the truth when steps stray by a few percent,
and what the run comes to in `bench vllm`'s check when its simulated agentaccel learns with each.

The truth is the server the check learns from the run (simulation/vllm_server.py). First, the
run's own logged step shapes (requests, tokens, context) are timed by the truth, with lognormal
scatter of the run's own within-shape size; each seed is one run of that scatter. Each learner
observes the steps in the plugin's batches and fits, and the script prints its price of one more
token in a step (its share of the step), beside the truth's, at a few batch shapes (min, median,
max over the seeds). Then
(`--simulate`) the run's blocks go through the check's simulated server once per learner:
agentaccel's tokens/s per workload and level, beside plain decoding's. An earlier learner is
read from git (`--at COMMIT`); it needs only engine/cost/model.py beside it.

    python scripts/lab/learner_versions.py /work/bench_runs/RUN/logs --at 06f7390 --seeds 8 --simulate
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from agentaccel.backends.step_costs import read_step_log
from agentaccel.bench.vllm import simulate as sim
from agentaccel.bench.vllm.runner import Measurement
from agentaccel.engine.cost import learner as current
from agentaccel.engine.cost import seed
from agentaccel.text.tokenization import load_tokenizer

SHAPES = ((1, 300), (8, 150), (16, 100), (8, 800), (16, 800))  # (requests, context each), 1.4 tokens each
BATCH = 100  # steps a refit sees at once (the plugin drains its timings twice a second)
LEARNER = "agentaccel/engine/cost/learner.py"


def learner_at(commit: str) -> types.ModuleType:
    """The learner module as it was at `commit`."""
    source = subprocess.run(["git", "show", f"{commit}:{LEARNER}"], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2]).stdout
    module = types.ModuleType(f"learner_{commit}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up there
    exec(compile(source, f"{commit}:{LEARNER}", "exec"), module.__dict__)  # noqa: S102 - our own file, from git
    return module


def price(model, requests: int, context: float) -> float:
    """One more token in a step of `requests` decoding requests over `context` tokens each, 1.4
    tokens a request already (StepCostModel.relative: against the same requests' plain step)."""
    drafted = 0.4 * requests
    return model.relative(requests, drafted + 1, context) / model.relative(requests, drafted, context) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a run kept by `agentaccel bench vllm --logs FOLDER`")
    ap.add_argument("--at", action="append", default=[], help="also the learner of this commit (repeatable)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--simulate", action="store_true", help="also the run's blocks, simulated with each learner")
    args = ap.parse_args()
    m = Measurement.load(args.folder)
    truth = sim.learned_server(args.folder, m)
    shapes = read_step_log(args.folder / "steps-agentaccel.jsonl")
    versions = {**{commit: learner_at(commit) for commit in args.at}, "this tree": current}
    prices: dict[str, list[list[float]]] = {name: [] for name in versions}
    fit_ms: dict[str, list[float]] = {name: [] for name in versions}
    for run in range(args.seeds):
        rng = np.random.default_rng(run)
        steps = [dataclasses.replace(s, seconds=float(truth.seconds(s.tokens, s.context, s.attention, s.requests))
                                     * float(rng.lognormal(0.0, truth.noise))) for s in shapes]
        for name, module in versions.items():
            learner = module.StepCostLearner(seed("cpu"))
            for start in range(0, len(steps), BATCH):
                learner.observe(steps[start:start + BATCH])
            started = time.perf_counter()
            model = learner.fit().model
            fit_ms[name].append(1e3 * (time.perf_counter() - started))
            prices[name].append([price(model, r, c) for r, c in SHAPES])
    table = Table(title=f"a draft token's learned price (share of the step), {args.seeds} runs of "
                        f"{truth.noise:.1%} scatter over {len(shapes):,} steps (min / median / max)")
    table.add_column("learner")
    table.add_column("a fit, ms (median)", justify="right")
    for r, c in SHAPES:
        table.add_column(f"{r} x {c} (truth {price(truth.model, r, c):.3f})", justify="right")
    for name, rows in prices.items():
        a = np.asarray(rows)
        spread = (f"{a[:, i].min():.3f} / {np.median(a[:, i]):.3f} / {a[:, i].max():.3f}" for i in range(len(SHAPES)))
        table.add_row(name, f"{statistics.median(fit_ms[name]):.1f}", *spread)
    Console().print(table)
    if args.simulate:
        simulated(m, truth, versions)


def simulated(m: Measurement, truth, versions: dict[str, types.ModuleType]) -> None:
    """The run's blocks through the check's simulated server, agentaccel learning with each
    learner: its tokens/s ÷ plain decoding's, per workload and level (the median over blocks)."""
    tok = load_tokenizer(None)
    plain = sim.predict(m, truth, ["none"], tok)
    table = Table(title="the check's simulated agentaccel ÷ plain decoding, by the learner it learns with")
    table.add_column("learner")
    cells = sorted({(w, level) for (_, w, level, _) in plain})
    for w, level in cells:
        table.add_column(f"{w} at {level}", justify="right")
    for name, module in versions.items():
        def make(method_name: str, module=module):  # the check's method, learning with this learner
            method = sim.make_method(method_name)
            method.learner = module.StepCostLearner(method.learner.seed)
            return method

        ours = sim.predict(m, truth, ["agentaccel"], tok, make=make)
        ratios = {cell: statistics.median(row["tokens_per_s"] / plain[("none", *k[1:])]["tokens_per_s"]
                                          for k, row in ours.items() if k[1:3] == cell) for cell in cells}
        table.add_row(name, *(f"{ratios[cell]:.3f}" for cell in cells))
    Console().print(table)


if __name__ == "__main__":
    main()
