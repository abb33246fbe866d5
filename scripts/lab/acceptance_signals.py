"""Is there a signal, beyond the drafter's own estimate D, that says whether a draft's first token
will be accepted? (issue 59.2) Each recorded call is replayed one request at a time with the
plugin's drafting (`backends/vllm/drafting.py`); at every step that drafts, the first token's D
(its estimated acceptance), whether the model wrote it, and what the step looks like:

- `structure`: where the output is in its text: inside a code fence, inside an open bracket
  (a tool call's or a function's arguments, a SQL sub-query), inside a quoted string, at a line's
  start, or elsewhere;
- `sql clause`: the last SQL keyword written (SELECT, FROM, WHERE, JOIN, GROUP/ORDER BY, ...);
- `request tree` / `stage tree`: what the request's own tree, and the stage's global tree, would
  draft first on their own (the paper's rule): the same token, another, or nothing;
- `siblings`: how many first tokens the trees hold after the context (a tree draft's roots);
- `match`: the draft's match length; `step`: how far into the output;
- `model p` (with `--drafter`, predictions from `agentaccel bench drafter-predictions`): the
  model drafter's probability of the draft's first token, given the true prefix (issue 58); only
  the calls the predictions hold are counted then (the others still grow the trees).

For each signal and D bin: each value's acceptance less its mean D (a bin is wide and its values'
D differ: this is the acceptance at a fixed D), and the spread of that (highest minus lowest over
the values with at least `--min-steps` steps). A spread over 5 points at a fixed D is a
signal the budget could use; none is the measured answer that the trees do not tell.

    python scripts/lab/acceptance_signals.py --db traces.db --source BIRD_DEV/deepseek --limit 3000
    python scripts/lab/acceptance_signals.py --db traces.db --stage swe-agent --source .traj --limit 1500
    python scripts/lab/acceptance_signals.py --db traces.db --source BIRD_DEV/deepseek --limit 3000 --drafter rsl.npz
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from agentaccel.backends.vllm.drafting import plugin_drafting
from agentaccel.engine import SuffixEngine
from agentaccel.engine.verification import accepted_length
from agentaccel.simulation import replay as rp
from agentaccel.simulation.drafter_predictions import DrafterPredictions
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.store import TraceStore

D_BINS = (0.0, 0.3, 0.6, 0.9, 1.01)  # the bins the calibration table used
SQL_CLAUSES = ("select", "from", "where", "join", "on", "group by", "order by", "having", "limit", "union",
               "case", "when", "as")
_SQL = re.compile(r"\b(" + "|".join(SQL_CLAUSES).replace(" ", r"\s+") + r")\b", re.IGNORECASE)


class TextPosition:
    """Where the output is, kept up to date token by token (no decoding of the whole output)."""

    def __init__(self) -> None:
        self.fences = self.depth = 0
        self.line = ""
        self.clause = "none"

    def add(self, piece: str) -> None:
        self.line = piece.rsplit("\n", 1)[1] if "\n" in piece else self.line + piece
        self.fences += piece.count("```")
        self.depth = max(0, self.depth + piece.count("(") + piece.count("{") + piece.count("[")
                         - piece.count(")") - piece.count("}") - piece.count("]"))
        found = _SQL.findall(self.line[-40:])
        if found:
            self.clause = re.sub(r"\s+", " ", found[-1].lower())

    def structure(self) -> str:
        if self.fences % 2:
            return "code fence"
        if self.line.count('"') % 2 or self.line.count("'") % 2:
            return "in quotes"
        if self.depth:
            return "in brackets"
        if not self.line.strip():
            return "line start"
        return "other"


def _count(n: int) -> str:
    return "3+" if n >= 3 else str(n)


def first_of(draft) -> int | None:
    return int(draft.token_ids[0]) if len(draft) else None


def agreement(own: int, other) -> str:
    first = first_of(other)
    return "silent" if first is None else "same" if first == own else "other"


P_BINS = (0.01, 0.05, 0.2, 0.6)  # the model's probability of a token: bins' upper edges
P_LABELS = ("<.01", ".01-.05", ".05-.2", ".2-.6", ">=.6")


def model_p(predictions, call, pos: int, token: int) -> str:
    """The bin of the model's probability of `token` at output position `pos` (the last of its top
    tokens' where `token` is not among them)."""
    top, prob = predictions
    hit = np.flatnonzero(top[pos] == token)
    p = float(prob[pos][hit[0]] if len(hit) else prob[pos][-1])
    return P_LABELS[int(np.searchsorted(P_BINS, p, side="right"))]


def replay_signals(calls, tok, max_tokens: int, drafter=None) -> list[dict]:
    """One row per drafting step: D, whether the first token was accepted, and every signal (with
    `drafter`, predictions: the model's probability too, on the calls they hold only)."""
    plugin = plugin_drafting()
    engine = SuffixEngine(max_depth=plugin.depth, config=plugin.config)
    alone = {tree: replace(plugin.config, mode="paper", tree=True, trees=(tree,), min_prob=0.1)
             for tree in ("request", "stage")}
    branching = replace(plugin.config, mode="paper", tree=True, trees=("request", "stage"), min_prob=0.0)
    pieces: dict[int, str] = {}
    rows, last_of_session = [], {}
    for call in track(calls, description="replaying", transient=True):
        key = f"c{call.call_id}"
        engine.start_request(key, call.prompt, call.stage, continue_from=last_of_session.get(call.session))
        out, pos, text = call.output, 0, TextPosition()
        predicted = drafter.of(call.prompt, out) if drafter is not None else None
        counted = drafter is None or predicted is not None
        while pos < len(out):
            draft = engine.speculate(key, max_tokens)
            acc = accepted_length(draft.token_ids, draft.parents, out[pos:]) if len(draft) else 0
            if pos and len(draft) and counted:  # the plugin drafts from the first output token on
                own = first_of(draft)
                tree = engine.speculate(key, 8, config=branching)
                rows.append({
                    "stage": call.stage, "d": float(draft.probs[0]), "accepted": acc > 0,
                    "structure": text.structure(), "sql clause": text.clause,
                    "request tree": agreement(own, engine.speculate(key, 1, config=alone["request"])),
                    "stage tree": agreement(own, engine.speculate(key, 1, config=alone["stage"])),
                    "siblings": _count(sum(1 for p in tree.parents if p == -1)),
                    "match": "1-2" if draft.match_len <= 2 else "3-7" if draft.match_len <= 7 else "8+",
                    "step": "first 16" if pos < 16 else "16-127" if pos < 128 else "128+",
                    **({"model p": model_p(predicted, call, pos, own)} if predicted is not None else {}),
                })
            step = out[pos : pos + min(acc + 1, len(out) - pos)]
            engine.extend(key, step)
            for t in step.tolist():
                if t not in pieces:
                    pieces[t] = tok.decode([t])
                text.add(pieces[t])
            pos += len(step)
        engine.finish_request(key, keep_output=True, retain=True)
        last_of_session[call.session] = key
    return rows


SIGNALS = ("structure", "sql clause", "request tree", "stage tree", "siblings", "match", "step")


def spreads(rows: list[dict], min_steps: int) -> dict:
    """By signal and D bin: each value's (steps, acceptance, mean D) and the spread of acceptance
    less mean D among the values with at least `min_steps` steps."""
    d = np.asarray([r["d"] for r in rows])
    ok = np.asarray([r["accepted"] for r in rows], dtype=float)
    bins = np.digitize(d, D_BINS[1:-1])
    out = {}
    for signal in (*SIGNALS, "model p") if rows and "model p" in rows[0] else SIGNALS:
        values = np.asarray([r[signal] for r in rows])
        per_bin = []
        for b in range(len(D_BINS) - 1):
            cells = {}
            for v in sorted(set(values[bins == b])):
                mask = (bins == b) & (values == v)
                cells[str(v)] = (int(mask.sum()), float(ok[mask].mean()), float(d[mask].mean()))
            # at a fixed D: what a value adds to its own D (a bin is wide; its values' D differ)
            big = [a - mean_d for n, a, mean_d in cells.values() if n >= min_steps]
            per_bin.append({"cells": cells, "spread": max(big) - min(big) if len(big) > 1 else 0.0})
        out[signal] = per_bin
    return out


def _cell(steps: int, acceptance: float, mean_d: float) -> str:
    return f"{(acceptance - mean_d) * 100:+.0f} ({steps:,})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--source")
    ap.add_argument("--stage", action="append")
    ap.add_argument("--limit", type=int, default=3000)
    ap.add_argument("--min-steps", type=int, default=200)
    ap.add_argument("--drafter", help="a model drafter's predictions (agentaccel bench drafter-predictions)")
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = load_tokenizer()
    with TraceStore(args.db, create=False) as store:
        calls = rp.load_calls(store, tok, stages=args.stage, source_like=args.source, limit=args.limit)
    drafter = DrafterPredictions.load(args.drafter) if args.drafter else None
    rows = replay_signals(calls, tok, plugin_drafting().max_tokens, drafter)
    result = {"calls": len(calls), "steps": len(rows), "d_bins": D_BINS, "signals": spreads(rows, args.min_steps)}
    by_stage = defaultdict(list)
    for r in rows:
        by_stage[r["stage"]].append(r)
    if len(by_stage) > 1:
        result["stages"] = {s: spreads(rs, args.min_steps) for s, rs in by_stage.items()}
    console = Console()
    labels = [f"D {lo:.1f}-{min(hi, 1):.1f}" for lo, hi in zip(D_BINS, D_BINS[1:], strict=False)]
    table = Table(title=f"first-token acceptance at fixed D by signal: {len(calls):,} calls, {len(rows):,} "
                        f"drafting steps (each value: acceptance − its mean D, in points, and its steps; spread: "
                        f"over the values with ≥ {args.min_steps} steps)")
    table.add_column("signal")
    table.add_column("value")
    for label in labels:
        table.add_column(label, justify="right")
    for signal, per_bin in result["signals"].items():
        values = sorted({v for b in per_bin for v in b["cells"]})
        for v in values:
            table.add_row(signal, v, *[_cell(*b["cells"][v]) if v in b["cells"] else "-" for b in per_bin])
        table.add_row("", "[bold]spread", *[f"[bold]{b['spread'] * 100:.1f} pt" for b in per_bin], end_section=True)
    console.print(table)
    if "stages" in result:
        widest = {s: max(((sig, max(b["spread"] for b in bins)) for sig, bins in sp.items()), key=lambda x: x[1])
                  for s, sp in result["stages"].items()}
        console.print("widest spread per stage: " + "; ".join(f"{s}: {sig} {w * 100:.1f} pt"
                                                              for s, (sig, w) in sorted(widest.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
