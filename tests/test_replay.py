"""The replay benchmark: simulated verifier, speculators, metrics, sweep, figures."""

import json
import subprocess
import sys

import numpy as np
import pytest
from traces_fixtures import repetitive_store

from agentaccel.engine.cost import Server, StepCostModel, parse
from agentaccel.engine.policy import default_config
from agentaccel.engine.verification import accepted_length
from agentaccel.simulation import methods
from agentaccel.simulation import replay as rp
from agentaccel.simulation import speculators as sp
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.store import TraceStore


def test_accepted_length_follows_the_longest_matching_path():
    truth = np.array([5, 6, 7, 8])
    # tree: 5 -> (6 -> 9, 6 -> 7 -> 8), 4
    tokens, parents = [5, 6, 9, 7, 8, 4], [-1, 0, 1, 1, 3, -1]
    assert accepted_length(tokens, parents, truth) == 4
    assert accepted_length([4, 5], [-1, 0], truth) == 0  # wrong first token: nothing below counts
    assert accepted_length([5, 6, 7], [-1, 0, 1], truth[:2]) == 2  # the call ends before the draft


def test_cost_profiles(tmp_path):
    assert parse("gpu").model.request_steps(np.array([0, 10]), np.array([0, 0])).tolist() == pytest.approx([1.0, 1.2])
    assert parse("c=0.1").model.per_token == pytest.approx(0.1)
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"name": "measured", "draft_tokens": [0, 16, 32], "step_ms": [48, 95, 132]}))
    steps = parse(str(f)).model.request_steps(np.array([0, 16, 32]), np.zeros(3))
    assert steps == pytest.approx([1.0, 95 / 48, 132 / 48], rel=0.03)
    for bad in ("nope", "c=x"):
        with pytest.raises(ValueError, match="a cost is one of"):
            parse(bad)
    f.write_text("{}")
    with pytest.raises(ValueError, match="draft_tokens"):
        parse(str(f))


def test_replay_metrics_behave(tmp_path):
    db = repetitive_store(tmp_path)
    with TraceStore(db) as store:
        calls = rp.load_calls(store, load_tokenizer())
    assert [c.stage for c in calls[:2]] == ["other", "sql"]  # time order
    specs = methods.build(["none", "ngram-tuned", "paper-linear", "agentaccel-embedded", "agentaccel"], parse("gpu"))
    profiles = [parse("gpu"), parse("cpu")]
    rows = {(r["speculator"], r["stage"]): r for r in rp.summarize(rp.replay(calls, specs), profiles)}
    none = rows[("none", "*")]
    assert none["mat"] == 1.0 and none["est_speedup"] == 1.0 and none["draft_tokens_per_step"] == 0
    tokens = none["output_tokens"]
    for name in ("paper-linear", "agentaccel-embedded", "agentaccel"):
        r = rows[(name, "*")]
        assert r["output_tokens"] == tokens  # every speculator produces exactly the recorded output
        assert r["mat"] > 2.0 and r["est_speedup"] > 1.5  # the outputs repeat: long drafts get accepted
        assert 0 < r["acceptance_rate"] <= 1
        assert set(r) >= {"mat", "acceptance_rate", "draft_tokens_per_step", "spec_us_per_step", "est_speedup"}
        assert r["est_speedup_by_profile"]["gpu"] >= r["est_speedup_by_profile"]["cpu"]
        # cutting every draft to its accepted part costs less for the same tokens (drafts are wrong sometimes)
        assert r["est_speedup_sized_exactly"] > r["est_speedup"]
    assert none["est_speedup_sized_exactly"] == 1.0
    assert rows[("paper-linear", "sql")]["calls"] + rows[("paper-linear", "other")]["calls"] == len(calls)


def test_warm_up_seeds_the_global_tree(tmp_path):
    db = repetitive_store(tmp_path, n=40)
    with TraceStore(db) as store:
        calls = rp.load_calls(store, load_tokenizer(), stages=["sql"])
    measured, warm = calls[10:], calls[:10]
    cold = rp.replay(measured, [sp.paper_tree()])["paper-tree"]["*"]
    hot = rp.replay(measured, [sp.paper_tree()], warm=warm)["paper-tree"]["*"]
    assert hot.tokens == cold.tokens and hot.steps < cold.steps


def test_bench_replay_cli_json_sweep_and_plots(tmp_path):
    db = repetitive_store(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "agentaccel.cli.main", "bench", "replay", "--db", str(db), "--warm", "6",
         "--speculators", "none,paper-tree,agentaccel", "--sweep", "alpha=1,4", "--sweep-base", "paper-tree",
         "--scaling", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "fig")],
        capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["calls"] == 24 and result["warm_calls"] == 6
    names = {r["speculator"] for r in result["rows"]}
    assert names == {"none", "paper-tree", "agentaccel", "paper-tree[alpha=1]", "paper-tree[alpha=4]"}
    assert set(result["best"]) == {"*", "sql", "other"}
    sizes = [size for size, _ in result["scaling"]["points"]]
    assert sizes[0] == 0 and sizes == sorted(sizes) and sizes[-1] > 0
    for png in ("mat_speedup_by_stage.png", "accepted_vs_match_length.png", "speedup_vs_tree_size.png"):
        assert (tmp_path / "fig" / png).stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "replay", "--db", str(db),
                          "--speculators", "none,magic"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--speculators: unknown method(s) magic" in bad.stderr


def test_a_measured_curve_cuts_agentaccel_drafts_to_their_best_size(tmp_path):
    db = repetitive_store(tmp_path)
    with TraceStore(db) as store:
        calls = rp.load_calls(store, load_tokenizer())
    # up to 3 draft tokens cost one plain step; from 4 on a step costs 4 or more: never worth it
    base = np.interp(np.arange(64), [0, 1, 4, 5, 33], [1.0, 1.0, 1.0, 4.0, 40.0], right=40.0)
    curve = Server("steps", StepCostModel(tuple(base.tolist())))
    (whole,) = methods.build(["agentaccel-embedded"], parse("gpu"))
    (cut,) = methods.build(["agentaccel-embedded"], curve)
    assert cut.config == default_config(curve)  # drafting as the backend does with a curve
    cut.name = "agentaccel-cut"
    tallies = rp.replay(calls, [whole, cut])
    w, c = tallies["agentaccel-embedded"]["*"], tallies["agentaccel-cut"]["*"]
    assert max(w.drafted_per_step) > 3  # uncut, the repetitive outputs get long drafts
    assert max(c.drafted_per_step) <= 3 and c.accepted > 0
    assert c.summary([curve])["est_speedup"] > w.summary([curve])["est_speedup"]


def test_oracles_bound_every_suffix_drafter(tmp_path):
    """oracle-1 drafts exactly the longest recorded continuation any tree holds after the last
    context token: no drafter copying from the trees can take fewer steps, nor pay less for
    what it gets accepted; a longer match (oracle-2) can only find less."""
    db = repetitive_store(tmp_path, n=40)
    with TraceStore(db) as store:
        calls = rp.load_calls(store, load_tokenizer())
    specs = methods.build(["paper-linear", "paper-tree", "agentaccel-embedded", "agentaccel", "oracle-1", "oracle-2"],
                          parse("gpu"))
    tallies = rp.replay(calls, specs)
    rows = {r["speculator"]: r for r in rp.summarize(tallies, [parse("gpu")]) if r["stage"] == "*"}
    one, two = rows["oracle-1"], rows["oracle-2"]
    assert one["acceptance_rate"] == 1.0 and two["acceptance_rate"] == 1.0  # it drafts only what is accepted
    assert one["est_speedup"] == one["est_speedup_sized_exactly"]
    assert one["mat"] >= two["mat"] > 1.5
    for name in ("paper-linear", "paper-tree", "agentaccel-embedded", "agentaccel"):
        assert one["mat"] >= rows[name]["mat"], name
        assert one["est_speedup"] >= rows[name]["est_speedup_sized_exactly"], name
    with pytest.raises(ValueError, match="k must be at least 1"):
        specs[-1].engine.longest_continuation("c1", [1], k=0)


def test_bench_replay_tenants_compares_trees_shared_and_kept_per_tenant(tmp_path):
    """`--tenants 2` deals the sessions to two tenants: drafting from one's own outputs alone gets
    less accepted than from everyone's, never a different output; `--tenant base` selects the
    calls of no tenant (here: all of them)."""
    db = repetitive_store(tmp_path)
    out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "replay", "--db", str(db),
                          "--tenants", "2", "--json", str(tmp_path / "t.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = {r["speculator"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"] if r["stage"] == "*"}
    assert set(rows) == {"none", "agentaccel-embedded", "agentaccel-embedded-tenants"}
    shared, apart = rows["agentaccel-embedded"], rows["agentaccel-embedded-tenants"]
    assert apart["output_tokens"] == shared["output_tokens"] == rows["none"]["output_tokens"]
    assert 1.5 < apart["mat"] < shared["mat"]
    base = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "replay", "--db", str(db),
                           "--tenant", "base", "--speculators", "none", "--json", str(tmp_path / "b.json")],
                          capture_output=True, text=True)
    assert base.returncode == 0, base.stderr
    assert json.loads((tmp_path / "b.json").read_text())["calls"] == 30
    other = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "replay", "--db", str(db),
                            "--tenant", "some-api-key"], capture_output=True, text=True)
    assert other.returncode == 2 and "0 calls selected" in other.stderr, other.stderr
