"""Why the hybrid trails the model drafter alone under load (issue 58): its choice, or its budget's
step cost? The selected calls run through the simulated batching server at N in flight, as
`bench server` runs them, four ways:

- `hybrid`: as `bench server --methods hybrid` (the step cost learned from the GPU seed);
- `hybrid, known cost`: its budget given the profile's own step cost from the first step;
- `hybrid, learner warmed`: the warm-up calls run through the same server first, so that the
  measured calls are drafted under a learner that has seen a run;
- `model alone`: the drafter's whole chain every step.

For `hybrid` it also counts, on the steps where the trees' draft was sent instead of the model's
chain, what the model's chain would have got there (teacher-forced from the predictions: exact
for a greedy chain), against what the trees' draft got: the choice's own cost.

    python scripts/lab/hybrid_under_load.py --db traces.db --source alpaca_eval/Meta-Llama-3-8B-Instruct \\
        --limit 805 --warm 405 --drafter chat.npz --concurrency 64
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentaccel.backends.vllm.drafting import DEFAULT_MODEL_TOKENS, plugin_drafting
from agentaccel.engine.cost import parse
from agentaccel.engine.cost.drafter_pass import DrafterPassCost
from agentaccel.simulation import batch_replay as br
from agentaccel.simulation import methods
from agentaccel.simulation.drafter_predictions import DrafterPredictions
from agentaccel.simulation.model_drafter import Hybrid
from agentaccel.simulation.replay import CallSelection
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.store import TraceStore


@dataclass
class Choice:
    """On the steps the trees' draft was sent: what it got, and what the model's chain would have."""

    steps: int = 0
    trees: int = 0
    model: int = 0


def watch_choice(hybrid: Hybrid, k: int) -> Choice:
    """Counts, for every step the hybrid sends a trees' draft, the model chain's accepted tokens
    there (the run of its predictions that match the output, cut at `k`)."""
    choice, would = Choice(), {}
    step, accepted = hybrid.step, hybrid.accepted

    def stepping(batch):
        drafts = step(batch)
        for key in batch.keys:
            found = hybrid.model._found.get(key) if key is not None else None
            if found is None:
                continue
            top, _, output = found
            at, j = hybrid.model._pos[key], 0
            while j < k and at + j < len(output) and top[at + j, 0] == output[at + j]:
                j += 1
            would[key] = j
        return drafts

    def counting(key, draft, got):
        accepted(key, draft, got)
        if len(draft) and not draft.own and key in would:
            choice.steps, choice.trees, choice.model = choice.steps + 1, choice.trees + got, choice.model + would[key]

    hybrid.step, hybrid.accepted = stepping, counting
    return choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True)
    ap.add_argument("--drafter", type=Path, required=True, help="predictions from `bench drafter-predictions`")
    ap.add_argument("--drafter-tokens", type=int, default=DEFAULT_MODEL_TOKENS)
    ap.add_argument("--drafter-cost", type=DrafterPassCost.parse, default=DrafterPassCost(),
                    help="FIRST[,FURTHER]: the drafter's passes, in plain steps of the batch")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--server", default="llama-3.1-8b@h100")
    ap.add_argument("--stage", action="append", default=[])
    ap.add_argument("--source")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--warm", type=int, default=0)
    args = ap.parse_args()

    server = parse(args.server)
    with TraceStore(args.db, create=False) as store:
        calls = CallSelection(stages=tuple(args.stage), source=args.source, limit=args.limit,
                              warm=args.warm).load(store, load_tokenizer(None))
    warm, measured = calls[:args.warm], calls[args.warm:]
    predictions = DrafterPredictions.load(args.drafter)
    k, cost, n = args.drafter_tokens, args.drafter_cost, args.concurrency
    plugin = plugin_drafting()
    chain = dict(config=plugin.config, depth=plugin.depth, max_tokens=plugin.max_tokens)

    def run(method, warm_run: bool = False) -> br.Result:
        for call in warm:
            method.warm(call.output, call.stage)
        if warm_run:
            br.simulate(br.sessions_of(warm), method, server, n, pass_cost=cost)
        return br.simulate(br.sessions_of(measured), method, server, n, pass_cost=cost)

    build = lambda name: methods.build([name], server, drafter=predictions, drafter_tokens=k, pass_cost=cost)[0]  # noqa: E731
    hybrid = build("hybrid")
    choice = watch_choice(hybrid, k)
    results = {"hybrid": run(hybrid),
               "hybrid, known cost": run(Hybrid("hybrid", predictions, k=k, pass_cost=cost, cost=server.model,
                                                **chain)),
               "hybrid, learner warmed": run(build("hybrid"), warm_run=True),
               "model alone": run(build("drafter"))}
    alone = results["model alone"].row()["tokens_per_s"]
    table = Table(title=f"{len(measured):,} calls at {n} in flight on {server.name}, a drafter pass {cost} of a step")
    for col in ("method", "tok/s", "÷ model alone", "MAT"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, result in results.items():
        row = result.row()
        table.add_row(name, f"{row['tokens_per_s']:,.0f}", f"{row['tokens_per_s'] / alone:.3f}", f"{row['mat']:.3f}")
    console = Console()
    console.print(table)
    console.print(f"the trees' draft sent on {choice.steps:,} steps: it got {choice.trees:,} tokens accepted, the "
                  f"model's chain would have got {choice.model:,} ({choice.model - choice.trees:+,}: "
                  f"{(choice.model - choice.trees) / max(results['hybrid'].tokens, 1):+.1%} of the output)")


if __name__ == "__main__":
    main()
