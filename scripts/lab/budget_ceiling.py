"""How close any step budget can come to the oracle with agentaccel's candidates: the batched
server of `bench server --concurrency`, the same calls, four ways of allocating each step's drafts.

- `oracle`: the candidates cut to exactly what the model accepts (simulation/batch_replay.py);
- `agentaccel-known`: the plugin's budget, priced with the server's true step cost;
- `budget`: the same allocation done here in Python on the candidates the engine grows, each node
  valued at its estimate D (what the native budget does: a check of this script);
- `budget-calibrated`: the same, each node valued at the acceptance rate that nodes of its D and
  depth actually had on these very calls (measured by a first replay): the best any calibration of
  the drafter's estimates could do, with the hindsight no server has.

What separates `budget-calibrated` from `oracle` is not pricing or calibration but knowing which
drafts will be accepted.

    python scripts/lab/budget_ceiling.py --db traces.db --source BIRD_DEV/deepseek --limit 3000 \\
        --server llama-3.1-8b@h100 --concurrency 1,16,64,256
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from agentaccel.backends.vllm.drafting import plugin_drafting
from agentaccel.engine import SuffixEngine
from agentaccel.engine.cost import parse
from agentaccel.engine.suffix_engine import _core
from agentaccel.simulation import batch_replay as br
from agentaccel.simulation import methods
from agentaccel.simulation import replay as rp
from agentaccel.simulation import speculators as sp
from agentaccel.simulation.speculator import EMPTY, Chain, Speculator
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.store import TraceStore

D_EDGES = np.asarray([0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01])
DEPTHS = ((0, 0), (1, 2), (3, 6), (7, 14), (15, 63))


def candidate_config():
    """The plugin's drafting configuration, grown as far as the trees go (the budget cuts)."""
    return replace(plugin_drafting().config, cost=0.0)


def measure_calibration(calls: list[rp.ReplayCall]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per depth group: (mean D, acceptance rate) of the candidates' nodes by D bin, on these calls."""
    nodes: list[tuple[float, int, float]] = []

    class Recording(sp.Suffix):
        def accepted(self, key, draft, accepted):
            nodes.extend((d, i, float(accepted > i)) for i, d in enumerate(draft.probs))

    rp.replay(calls, [Recording("candidates", candidate_config(), 32, 64)])
    r = np.asarray(nodes)
    out = {}
    for g, (lo, hi) in enumerate(DEPTHS):
        xs, ys = [0.0], [0.0]
        for a, b in zip(D_EDGES, D_EDGES[1:], strict=False):
            m = (r[:, 0] >= a) & (r[:, 0] < b) & (r[:, 1] >= lo) & (r[:, 1] <= hi)
            if m.sum() > 30:
                xs.append(float(r[m, 0].mean()))
                ys.append(float(r[m, 2].mean()))
        xs.append(1.0)
        ys.append(1.0)
        out[g] = (np.asarray(xs), np.maximum.accumulate(np.asarray(ys)))
    return out


class PythonBudget(Speculator):
    """The step budget over the engine's candidates, each node valued by `value(D, depth)`."""

    def __init__(self, name: str, server, value=lambda d, depth: d) -> None:
        self.name, self.cost, self.value = name, server.model.to_native(), value
        self.engine = SuffixEngine(max_depth=64, config=candidate_config())
        self.limit: dict[str, int] = {}
        self.leaving: list[str] = []

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        self.engine.start_request(key, np.asarray(prompt, dtype=np.uint32), stage=stage)
        self.limit[key] = max_total

    def end(self, key):
        self.leaving.append(key)  # finished after the next step's drafts, as the native drafter retires it

    def step(self, batch):
        out = [EMPTY] * len(batch.keys)
        candidates, contexts = [], []
        decoding, context, attention, listed = 0, 0.0, 0.0, 0
        for i, key in enumerate(batch.keys):
            if key is None:
                continue
            n = int(batch.num_tokens[i])
            context += n
            listed += 1
            if not batch.sampled[i]:
                continue
            decoding += 1
            attention += n
            self.engine.extend(key, batch.sampled[i])
            k = min(32, batch.max_len - n - 1, self.limit[key] - n - 1)
            draft = self.engine.speculate(key, k) if k > 0 else None
            if draft is not None and draft.token_ids:
                candidates.append((i, list(draft.token_ids), [self.value(d, j) for j, d in enumerate(draft.probs)]))
                contexts.append(float(n))
        for key in self.leaving:
            self.engine.finish_request(key, keep_output=True)
            del self.limit[key]
        self.leaving.clear()
        if candidates:
            keep = _core.allocate_budget([c[2] for c in candidates], [1.0] * len(candidates), contexts, decoding,
                                         context, attention, listed, self.cost)
            for (i, tokens, _), k in zip(candidates, keep, strict=True):
                out[i] = Chain(tokens[:k])
        return out


def calibrated(table):
    def value(d: float, depth: int) -> float:
        g = next(k for k, (lo, hi) in enumerate(DEPTHS) if lo <= depth <= hi)
        xs, ys = table[g]
        return float(np.interp(d, xs, ys))

    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True)
    ap.add_argument("--source")
    ap.add_argument("--stage", action="append")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--server", default="llama-3.1-8b@h100")
    ap.add_argument("--concurrency", default="1,16,64,256")
    args = ap.parse_args()
    server = parse(args.server)
    with TraceStore(args.db, create=False) as store:
        calls = rp.load_calls(store, load_tokenizer(), stages=args.stage, source_like=args.source, limit=args.limit)
    table = measure_calibration(calls)
    streams = br.sessions_of(calls)
    print(f"{len(calls):,} calls, {len(streams):,} streams, on {server.name} ({server.origin})")
    for n in (int(x) for x in args.concurrency.split(",")):
        built = [*methods.build(["oracle", "agentaccel-known"], server), PythonBudget("budget", server),
                 PythonBudget("budget-calibrated", server, calibrated(table))]
        rows = {m.name: br.simulate(streams, m, server, n).row() for m in built}
        oracle = rows["oracle"]["tokens_per_s"]
        print(f"N={n:4d} " + "  ".join(f"{name} {r['tokens_per_s'] / oracle:.3f} (MAT {r['mat']:.2f}, "
                                          f"{r['draft_tokens_per_step']:.2f} drafted)"
                                          for name, r in rows.items() if name != "oracle"), flush=True)


if __name__ == "__main__":
    main()
