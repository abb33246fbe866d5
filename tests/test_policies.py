"""Per-stage drafting policies: resolved once (defaults, tuned, --spec-config), tuned on the trace
store by `agentaccel tune`, calibrated online while serving, shown in /metrics and `traces stats`."""

import json
import subprocess
import sys
from dataclasses import replace

import httpx
import numpy as np
import pytest
from servers import ServerThread
from traces_fixtures import chat_store

from agentaccel.backends.policies import CalibrationKeeper, serving_policies
from agentaccel.backends.replay import ReplayBackend
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.cost import parse
from agentaccel.engine.online import OnlineCalibration
from agentaccel.engine.policy import default_config, read_file, resolve
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.simulation import replay as rp
from agentaccel.simulation import speculators as sp
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces import stage_policies
from agentaccel.traces.store import TraceStore

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789")


def pipeline_store(tmp_path, n=60, rare=5):
    """A two-stage pipeline: "sql" answers repeat with small changes, "chat" answers are random
    characters (what no tree predicts); "rare" has only a few calls."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        q = f"question {i} about table t{i % 3}"
        sql = f"SELECT name, email FROM users WHERE id = {i} AND team = 't{i % 3}' ORDER BY name LIMIT {i % 7}"
        chat = "".join(rng.choice(CHARS, size=160))
        for stage, answer in (("sql", sql), ("chat", chat)):
            rows.append({"messages": [{"role": "user", "content": f"{stage}: {q}"},
                                      {"role": "assistant", "content": answer}],
                         "stage": stage, "metadata": {"created_at": 1000.0 + len(rows)}})
    for i in range(rare):
        rows.append({"messages": [{"role": "user", "content": f"rare {i}"}, {"role": "assistant", "content": "ok"}],
                     "stage": "rare", "metadata": {"created_at": 5000.0 + i}})
    return chat_store(tmp_path, rows)


def test_precedence_defaults_then_star_then_tuned_then_the_file_which_says_it_wins(tmp_path):
    base = default_config(parse("gpu"))
    f = tmp_path / "policy.json"
    f.write_text(json.dumps({"*": {"min_prob": 0.1}, "sql": {"tree": False}, "chat": {"min_score": 3}}))
    said = []
    tuned = {"sql": {"config": {"min_score": 1.0, "confidence": 0.5}, "calls": 300, "tuned_at": "2026-11-23"}}
    p = resolve(base, tuned=tuned, file=read_file(f), file_name=str(f), say=said.append)
    assert p.default == replace(base, min_prob=0.1)
    assert p.stages["sql"] == replace(base, min_prob=0.1, min_score=1.0, confidence=0.5, tree=False)
    assert p.stages["chat"] == replace(base, min_prob=0.1, min_score=3)
    assert p.origin["sql"] == str(f) and any("sql" in s and "wins over its tuned policy" in s for s in said)
    engine = SuffixEngine()
    p.install(engine)
    assert engine.policy("sql") == p.stages["sql"] and engine.policy("other") == p.default
    # every field of every policy, read back unchanged (what the vLLM plugin receives)
    again = resolve(SpecConfig(), file=json.loads(json.dumps(p.as_dict())))
    assert again.default == p.default and again.stages == p.stages
    for bad, problem in (({"sql": {"alpah": 2}}, "alpah"), ({"sql": {"min_prob": 7}}, "min_prob"),
                         ({"sql": {"mode": "fast"}}, "mode"), ({"sql": 3}, "expected")):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=problem) as e:
            read_file(f)
        assert str(f) in str(e.value)


def test_the_engine_drafts_with_the_policy_of_the_requests_stage():
    engine = SuffixEngine()
    for _ in range(3):
        engine.add_document(list(range(10, 40)), "a")
        engine.add_document(list(range(10, 40)), "b")
    engine.set_policy(SpecConfig(max_tokens=3), "b")
    engine.start_request("x", [10, 11, 12], "a")
    engine.start_request("y", [10, 11, 12], "b")
    assert len(engine.speculate("x", 16).token_ids) == 16 and len(engine.speculate("y", 16).token_ids) == 3
    engine.set_policy(SpecConfig(max_tokens=5))  # a new default reaches "a", not "b"
    assert len(engine.speculate("x", 16).token_ids) == 5 and len(engine.speculate("y", 16).token_ids) == 3
    engine.clear_policy("b")
    assert len(engine.speculate("y", 16).token_ids) == 5
    assert SpecConfig(mode="agentaccel").mode == "mixture"  # the earlier name, read from old files


def test_tune_stores_per_stage_policies_that_serve_loads_and_stats_shows(tmp_path):
    db = pipeline_store(tmp_path)
    cli = [sys.executable, "-m", "agentaccel.cli.main"]
    dry = subprocess.run([*cli, "tune", "--db", str(db), "--calls", "40", "--warm", "20", "--min-calls", "10",
                          "--dry-run", "--json", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr
    assert "dry run" in dry.stdout
    with TraceStore(db) as store:
        assert stage_policies.read(store) == {}  # nothing stored
    report = {s["stage"]: s for s in json.loads((tmp_path / "t.json").read_text())["stages"]}
    assert "only 5 calls" in report["rare"]["note"]  # too few calls: the defaults, and it says so
    assert report["sql"]["tuned_speedup"] >= report["sql"]["default_speedup"]
    # near-random outputs: tuned to draft less than the defaults, which lose to their verification cost
    assert report["chat"]["default_speedup"] < 1.0 <= report["chat"]["tuned_speedup"]
    run = subprocess.run([*cli, "tune", "--db", str(db), "--calls", "40", "--warm", "20", "--min-calls", "10"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    with TraceStore(db) as store:
        rows = stage_policies.read(store)
    assert "rare" not in rows and rows["chat"].config == report["chat"]["settings"] and rows["chat"].calls == 40
    policies, online = serving_policies(default_config(parse("gpu")), db=db)
    assert policies.stages["chat"] == replace(policies.default, **report["chat"]["settings"])
    assert online.trusts == {} and online.references["chat"] == pytest.approx(rows["chat"].calibration)
    assert policies.origin["chat"].startswith("tuned ")
    stats = subprocess.run([*cli, "traces", "stats", "--db", str(db)], capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0 and "drafting policies" in stats.stdout
    chat_line = next(line for line in stats.stdout.splitlines() if line.startswith("│ chat") and "x" in line)
    assert "gpu" in chat_line and "40" in chat_line
    missing = subprocess.run([*cli, "tune", "--db", str(db), "--stage", "nope"], capture_output=True, text=True)
    assert missing.returncode != 0 and "nope" in missing.stderr


def test_online_calibration_stops_long_drafts_on_a_stage_whose_acceptance_collapses(tmp_path):
    db = pipeline_store(tmp_path, n=80)
    with TraceStore(db) as store:
        calls = rp.load_calls(store, load_tokenizer(), stages=["chat"])
    gpu = parse("gpu")
    wrong = replace(default_config(gpu), min_score=0.0, confidence=2.0, min_prob=0.01)  # drafts anything
    fixed = sp.Suffix("fixed", wrong)
    online = sp.Suffix("online", wrong, online=True)
    tallies = rp.replay(calls, [fixed, online])
    f, o = tallies["fixed"]["chat"], tallies["online"]["chat"]
    assert o.drafted < f.drafted / 2  # it stopped drafting what is not accepted
    assert o.summary([gpu])["est_speedup"] > f.summary([gpu])["est_speedup"]
    state = online.online.state()["chat"]
    assert state["trust"] < 0.5 and state["changes"] >= 1
    assert online.engine.policy("chat").confidence == pytest.approx(2.0 * state["trust"])
    # saved to the store, and a restart resumes from it
    CalibrationKeeper(online.online, db, every=3600).close()
    _, online_state = serving_policies(default_config(gpu), db=db)
    assert online_state.trusts == {"chat": pytest.approx(state["trust"])}
    engine = SuffixEngine(config=wrong)
    OnlineCalibration(engine).restore(online_state.trusts)
    assert engine.policy("chat").confidence == pytest.approx(2.0 * state["trust"])


def test_metrics_show_each_stages_policy_and_online_factor(tmp_path):
    db = pipeline_store(tmp_path, n=12)
    gpu = parse("gpu")
    engine = SuffixEngine(config=default_config(gpu))
    engine.set_policy(replace(default_config(gpu), min_score=1.5), "sql")
    calibration = OnlineCalibration(engine)
    with TraceStore(db) as store:
        backend = ReplayBackend(store, load_tokenizer(), gpu, step_ms=0.0, engine=engine, online=calibration)
    with ServerThread(create_app(ProxyConfig(record=False), backend)) as server:
        url = server.url
        for i in range(6):  # the recorded prompts of stage "chat"
            m = [{"role": "user", "content": f"chat: question {i} about table t{i % 3}"}]
            r = httpx.post(url + "/v1/chat/completions", json={"model": "replay", "messages": m},
                           headers={"X-Agentaccel-Stage": "chat"}, timeout=60)
            assert r.status_code == 200, r.text
        text = httpx.get(url + "/metrics").text
    assert 'agentaccel_policy_min_score{stage="sql"} 1.5' in text
    assert 'agentaccel_policy_min_score{stage="*"} 0.0' in text
    assert 'agentaccel_policy_online_factor{stage="chat"}' in text
    assert 'agentaccel_policy_mean_draft_tokens{stage="chat"}' in text
