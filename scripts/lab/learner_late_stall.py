"""Replays a step log with a stall planted after the learner's first steps, and a budget that stops
drafting the sizes it prices out (as the plugin's does), and prints what the learned step cost says
of each size, over the truth, as the steps go on (issue 61: does the learner recover?).

    python scripts/lab/learner_late_stall.py [--rounds 128] [--stall-tokens 24] [--stall-seconds 0.864]

The server: 30 ms a step plus 2 ms a token (a CPU), 5 % noise; 300 steps of 1-16 tokens, then one
step of `--stall-tokens` taking `--stall-seconds` (a compile of a shape not run before), then rounds
of 32 steps whose sizes the budget still drafts: those the fit prices within 1.5x of the truth.
"""

from __future__ import annotations

import argparse

import numpy as np

from agentaccel.engine.cost import StepCostLearner, StepCostModel, TimedStep, seed

TRUTH = StepCostModel(tuple(0.030 + 0.002 * np.arange(8193)))
SHOWN = (2, 4, 8, 16, 24, 32, 48)


def step(tokens: float, rng, seconds: float | None = None) -> TimedStep:
    taken = seconds if seconds is not None else float(TRUTH.seconds(tokens, 20, 20 * tokens)) * rng.lognormal(0, 0.05)
    return TimedStep(tokens, tokens, 20, 20 * tokens, taken)


def over_truth(learner: StepCostLearner, tokens: float) -> float:
    return float(learner.fit().model.seconds(tokens, 20, 20 * tokens)) / float(TRUTH.seconds(tokens, 20, 20 * tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=128, help="rounds of 32 steps after the stall")
    parser.add_argument("--stall-tokens", type=float, default=24.0)
    parser.add_argument("--stall-seconds", type=float, default=0.864)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    learner = StepCostLearner(seed("cpu"))

    def row(label: str, allowed: str = "") -> None:
        print(f"{label:>14} {allowed:>8} " + " ".join(f"{over_truth(learner, t):6.2f}" for t in SHOWN), flush=True)

    print(f"{'steps':>14} {'drafted':>8} " + " ".join(f"{t:>6}" for t in SHOWN) + "   (learned / true seconds)")
    steps = [step(float(rng.integers(1, 17)), rng) for _ in range(300)]
    for start in range(0, len(steps), 32):  # as the plugin hands them over
        learner.observe(steps[start:start + 32])
    row("300")
    learner.observe([step(args.stall_tokens, rng, args.stall_seconds)])
    row("+ the stall")
    for k in range(1, args.rounds + 1):
        allowed = [t for t in range(1, 33) if over_truth(learner, t) < 1.5]
        learner.observe([step(float(rng.choice(allowed)), rng) for _ in range(32)])
        if k & (k - 1) == 0 or k == args.rounds:  # 1, 2, 4, 8, ... rounds
            row(f"+{k * 32}", f"<= {max(allowed)}")


if __name__ == "__main__":
    main()
