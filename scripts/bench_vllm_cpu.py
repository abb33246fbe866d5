"""vLLM behind `agentaccel serve --backend vllm`: decoding speed with our suffix proposer on and off.

Every call of a text-to-SQL pipeline (e2e's `sql` workload: classify -> schema link -> SQL ->
refine -> final over Spider questions) is sent twice through the proxy, once with
`vllm_xargs.speculate=false` (plain decoding in the same server; such requests are not learned
from) and once with drafting on; outputs must match (greedy, float32). Prefix caching is off so
the second send of a prompt does not skip its prefill. Prints tokens/s both ways and the proposer's per-stage stats.

    python scripts/bench_vllm_cpu.py --questions 4
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from agentaccel.backends.local.model import default_model_folder
from agentaccel.backends.vllm.backend import free_port
from agentaccel.bench.corpus import default_traces_dir
from agentaccel.bench.e2e import sql_pipeline
from agentaccel.bench.processes import wait_healthy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "vllm", "--model",
             str(default_model_folder()), "--served-model-name", "smol", "--port", str(port), "--db",
             str(Path(tmp) / "t.db"), "--no-seed", "--", "--dtype", "float32", "--enforce-eager",
             "--max-model-len", "4096", "--no-enable-prefix-caching"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_healthy(url, proc, 600, ready=lambda health: health.get("state") == "ready")
            totals = {False: [0, 0.0], True: [0, 0.0]}  # speculate -> [tokens, seconds]
            mismatches = 0

            def generate(messages, stage):
                nonlocal mismatches
                texts = {}
                for speculate in (False, True):
                    body = {"model": "smol", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                            "vllm_xargs": {"speculate": speculate}}
                    t0 = time.perf_counter()
                    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": stage},
                                   timeout=600).json()
                    totals[speculate][1] += time.perf_counter() - t0
                    totals[speculate][0] += r["usage"]["completion_tokens"]
                    texts[speculate] = r["choices"][0]["message"]["content"]
                mismatches += texts[False] != texts[True]
                return texts[True]

            sql_pipeline(default_traces_dir(), args.questions, generate)
            plain, spec = (totals[False][0] / totals[False][1]), (totals[True][0] / totals[True][1])
            print(f"calls: {5 * args.questions}, tokens: {totals[True][0]}, outputs differing: {mismatches}")
            print(f"tokens/s without drafts {plain:.1f}, with agentaccel drafts {spec:.1f}: {spec / plain:.2f}x")
            for line in httpx.get(url + "/metrics").text.splitlines():
                if line.startswith(("agentaccel_acceptance_rate", "agentaccel_mean_accepted_length")):
                    print(line)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
