"""What step cost the simulated agentaccel learns in `bench vllm`'s simulator check, against the
simulated server it runs on and the step cost the real server learned (issue 58: it showed the
check's learner fitting a step cost unlike its server's, which made the simulated budget draft
about twice the tokens a step on chat; docs/lab/NOTEBOOK.md, "The check's learner").

A kept run (`bench vllm --logs FOLDER`) is simulated for agentaccel alone, as the check does; then,
at steps of 1 / 16 / 64 / 256 tokens (no context): the simulated server's seconds, what the
simulated agentaccel's learner fitted by the end, and what the real server's learner had fitted
(its stats file); then a step of 8 requests of 1,500 tokens of context each, drafting 0 / 1 / 3
tokens a request, as the simulated server and the simulated learner price it, with their
per-context, per-attention and per-request terms.

    python scripts/lab/simulated_step_cost.py /work/bench_runs/RUN/logs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentaccel.bench.vllm import simulate as sim
from agentaccel.bench.vllm.runner import Measurement
from agentaccel.text.tokenization import load_tokenizer

TOKENS = (1, 16, 64, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a run kept by `agentaccel bench vllm --logs FOLDER`")
    args = ap.parse_args()
    m = Measurement.load(args.folder)
    server = sim.learned_server(args.folder, m)
    built = []

    def make(name: str):
        built.append(sim.make_method(name))
        return built[-1]

    predicted = sim.predict(m, server, ["agentaccel"], load_tokenizer(None), make=make)
    learned = built[-1].learner.fit().model
    real = json.loads((args.folder / "stats-agentaccel.json").read_text())["drafter"].get("step_seconds", {})
    table = Table(title="a step of T tokens, seconds")
    for col in ("T", "simulated server", "simulated agentaccel learned", "real server learned"):
        table.add_column(col, justify="right")
    for t in TOKENS:
        table.add_row(str(t), f"{float(server.seconds(t, 0, 0, 1)):.4f}", f"{float(learned.seconds(t, 0, 0, 1)):.4f}",
                      f"{real[str(t)]:.4f}" if str(t) in real else "-")
    console = Console()
    console.print(table)
    for label, cost in (("simulated server", server.model), ("simulated agentaccel learned", learned)):
        steps = [float(cost.seconds(8 * (1 + d), 8 * 1500.0, 8 * (1 + d) * 1500.0, 8)) for d in (0, 1, 3)]
        console.print(f"{label}: 8 requests of 1,500 context drafting 0 / 1 / 3: "
                      + " / ".join(f"{x:.3f} s" for x in steps)
                      + f" (per context {cost.per_context:.2e}, per attention {cost.per_attention:.2e}, "
                      f"per request {cost.per_request:.2e})")
    for (_, workload, level, rep), row in sorted(predicted.items()):
        console.print(f"{workload} at {level} (rep {rep}): simulated draft {row['draft_tokens_per_step']:.2f} a step, "
                      f"acceptance {row['acceptance']:.0%}, MAT {row['mat']:.2f}")


if __name__ == "__main__":
    main()
