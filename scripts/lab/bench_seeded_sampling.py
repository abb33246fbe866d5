"""What not drafting for seeded sampled requests costs them, measured on a real vLLM server
(`agentaccel serve --backend vllm`, the default model, float32): the same sampled calls
(temperature 0.8) sent in turns as unseeded with speculation (what drafting gives a sampled
request), seeded (not drafted for, so that it repeats: docs/SERVING.md, "What repeats") and with
`vllm_xargs.speculate=false` (plain decoding). Prints tokens/s per way, and checks that every
seeded call gave the same text in every round.

    python scripts/lab/bench_seeded_sampling.py --calls 12 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from servers import free_port, wait_healthy  # noqa: E402

from agentaccel.backends.local.model import default_model_folder  # noqa: E402
from agentaccel.bench.vllm.sources import BUNDLED  # noqa: E402
from agentaccel.processes import stop_group  # noqa: E402


def prompts(n: int) -> list[str]:
    data = json.loads((BUNDLED / "text2sql_questions.json").read_text())
    schema = json.dumps(data["databases"])[:1500]
    return [f"Database schema: {schema}\nWrite one SQL query that answers: {q['question']}"
            for q in data["questions"][:n]]


def call(url: str, prompt: str, mode: str, seed: int) -> tuple[str, int, float]:
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": 96,
            "temperature": 0.8}
    if mode == "seeded":
        body["seed"] = seed
    if mode == "plain":
        body["vllm_xargs"] = {"speculate": False}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": "sql"}, timeout=600)
    r.raise_for_status()
    reply = r.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "serve.log", "w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "vllm", "--model",
             str(default_model_folder()), "--served-model-name", "smol", "--port", str(port), "--db",
             str(Path(tmp) / "t.db"), "--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, 900, ready=lambda h: h.get("state") == "ready")
            calls = prompts(args.calls)
            for p in calls[:4]:  # warm-up: the stage tree learns a few answers, every way the same
                call(url, p, "plain", 0)
            seconds = {m: [] for m in ("unseeded", "seeded", "plain")}
            tokens = {m: 0 for m in seconds}
            texts: dict[int, str] = {}
            repeats = 0
            for r in range(args.rounds):
                for mode in seconds:
                    before = time.perf_counter()
                    for i, p in enumerate(calls):
                        text, n, _ = call(url, p, mode, seed=1000 + i)
                        tokens[mode] += n
                        if mode == "seeded":
                            repeats += texts.setdefault(i, text) == text
                    seconds[mode].append(time.perf_counter() - before)
                print(f"round {r + 1}: " + ", ".join(f"{m} {s[-1]:.1f} s" for m, s in seconds.items()), flush=True)
            for mode, s in seconds.items():
                rate = tokens[mode] / sum(s)
                print(f"{mode:9s} {rate:7.1f} tok/s (blocks {', '.join(f'{x:.1f}' for x in s)} s)")
            plain = tokens["plain"] / sum(seconds["plain"])
            print(f"unseeded / plain {tokens['unseeded'] / sum(seconds['unseeded']) / plain:.3f}, "
                  f"seeded / plain {tokens['seeded'] / sum(seconds['seeded']) / plain:.3f}; "
                  f"seeded calls that repeated: {repeats} of {args.calls * args.rounds}")
            print("median block s: " + ", ".join(f"{m} {statistics.median(s):.1f}" for m, s in seconds.items()))
        finally:
            stop_group(proc, 60)


if __name__ == "__main__":
    main()
