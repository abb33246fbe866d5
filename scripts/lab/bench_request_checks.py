"""The proxy's per-request checks side by side: another revision's JSON parsing, validation and
stage tagging against the working tree's, taking turns on the same bodies and stream chunks.

    python scripts/lab/bench_request_checks.py --base 3d5468c --rounds 5

Bodies: a short chat call, an agent call (40 messages, a tools list, code in the content: ~60 KB),
a streamed chunk. Prints microseconds per call (median of the rounds) and the ratio new / base.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("agentaccel/jsonfast.py", "agentaccel/proxy/validation.py", "agentaccel/proxy/tagging.py")


def load(revision: str | None) -> dict[str, types.ModuleType]:
    """jsonfast, validation and tagging as of `revision` (None: the working tree), each module
    wired to its siblings of the same revision."""
    out: dict[str, types.ModuleType] = {}
    for path in MODULES:
        source = (ROOT / path).read_text() if revision is None else subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{revision}:{path}"], capture_output=True, text=True,
            check=True).stdout
        name = Path(path).stem
        module = types.ModuleType(f"{name}_{revision or 'tree'}")
        module.__dict__["jsonfast"] = out.get("jsonfast")
        sys.modules[module.__name__] = module  # dataclasses look their module up there
        exec(compile(source.replace("from agentaccel import jsonfast\n", ""), path, "exec"), module.__dict__)
        out[name] = module
    return out


def bodies() -> dict[str, bytes]:
    code = "def f(x):\n    return {'a': [x, {'b': x}]}\n" * 40
    tools = [{"type": "function", "function": {"name": f"tool{i}", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "path": {"type": "string"}}}}}
        for i in range(6)]
    agent = [{"role": "system", "content": "You are an agent."}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"step {i}\n{code}"} for i in range(40)]
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}
    return {"short chat call": json.dumps({"model": "m", "messages": agent[:2], "max_tokens": 64}).encode(),
            "agent call": json.dumps({"model": "m", "messages": agent, "tools": tools,
                                      "metadata": {"tags": ["agent:CodeActAgent"]}}).encode(),
            "stream chunk": json.dumps(chunk).encode()}


def request_path(mods, raw: bytes) -> None:
    body = mods["validation"].parse_json(raw)
    mods["validation"].validate("chat", body)
    mods["tagging"].resolve({}, body, [])


def chunk_path(mods, raw: bytes) -> None:
    mods["jsonfast"].loads(raw, exact=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the revision to compare with (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round and body")
    args = parser.parse_args()
    sides = {"base": load(args.base), "new": load(None)}
    print(f"{'body':<18}{'base µs':>10}{'new µs':>10}{'new/base':>10}")
    for label, raw in bodies().items():
        run = chunk_path if label == "stream chunk" else request_path
        times = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, mods in sides.items():  # taking turns: the machine's slow phases hit both
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    run(mods, raw)
                times[side].append((time.perf_counter() - t0) / args.calls * 1e6)
        base, new = statistics.median(times["base"]), statistics.median(times["new"])
        print(f"{label:<18}{base:>10.2f}{new:>10.2f}{new / base:>10.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
