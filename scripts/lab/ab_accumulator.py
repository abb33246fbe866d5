"""The proxy's per-chunk accumulation (proxy/accumulate.py, on every relayed stream event) of a
git revision against the working tree's, taking turns in one process: nanoseconds a chunk.

    python scripts/lab/ab_accumulator.py 49741de
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentaccel import jsonfast

REPO = Path(__file__).resolve().parents[2]
MODULE = "agentaccel/proxy/accumulate.py"
CHUNK = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}


def load(source: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def per_chunk(module, chunks: int, per_stream: int = 16) -> float:
    chunk = jsonfast.loads(jsonfast.dumps(CHUNK))
    started = time.perf_counter()
    for _ in range(chunks // per_stream):
        acc = module.Accumulator("chat")
        for _ in range(per_stream):
            acc.add(chunk)
        acc.finish()
    return (time.perf_counter() - started) / chunks * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the revision to compare with (its accumulate.py)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=200_000)
    args = parser.parse_args()
    before = load(subprocess.run(["git", "show", f"{args.rev}:{MODULE}"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout, "accumulate_before")
    after = load((REPO / MODULE).read_text(), "accumulate_after")
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, module in (("before", before), ("after", after)):
            times[name].append(per_chunk(module, args.chunks))
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.0f} ns a chunk (median of {args.rounds}; "
              f"{', '.join(f'{v:.0f}' for v in values)})")
    print(f"after / before: {statistics.median(times['after']) / statistics.median(times['before']):.3f}")


if __name__ == "__main__":
    main()
