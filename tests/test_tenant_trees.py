"""Tenants apart in the engine and the trace store (issue 44): a scope's outputs are drafted for
that scope alone, the base (what the operator seeded) for everyone; the trees keep their scopes
through save / load and recycling; the memory budget evicts from the scope holding the most; the
store keeps each call's tenant, and seeding, the follower and snapshots put it in its scope."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentaccel.backends import snapshots
from agentaccel.backends.follower import StoreFollower, seed_then_follow
from agentaccel.backends.seeding import seed_from_store
from agentaccel.engine import SpecConfig, SuffixEngine, scoped_stage, split_stage
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.recorder import RecordedCall, Recorder
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore
from agentaccel.traces.tenants import BASE, parse_tenant, tenant_of

SECRET = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]  # tenant A's answer
SHARED = [201, 202, 203, 204, 205, 206]  # imported: the base


def copies(draft: list[int], text: list[int]) -> bool:
    """The draft is a prefix of `text` (paper mode drafts as far as its pattern length allows)."""
    return bool(draft) and draft == text[:len(draft)]


def drafted(engine: SuffixEngine, prompt: list[int], scope: str | None, stage: str = "s", **config) -> list[int]:
    rid = f"r-{scope}-{stage}-{len(prompt)}"
    engine.start_request(rid, prompt, stage=stage, scope=scope)
    try:
        return engine.speculate(rid, 16, **config).token_ids
    finally:
        engine.finish_request(rid, keep_output=False)


@pytest.mark.parametrize("mode", ["mixture", "paper"])
def test_a_scope_drafts_its_own_answers_and_the_base_never_another_scopes(mode):
    engine = SuffixEngine()
    engine.add_document(SECRET, stage="s", scope="tA")
    engine.add_document(SHARED, stage="s")
    engine.add_document([301, 302, 303, 999], stage="other")  # a base document in another stage
    config = {"config": SpecConfig(mode=mode, tree=False)}
    assert copies(drafted(engine, SECRET[:3], "tA", **config), SECRET[3:])
    for scope in ("tB", None):  # another tenant, a server without keys
        assert drafted(engine, SECRET[:3], scope, **config) == []
        assert copies(drafted(engine, SHARED[:2], scope, **config), SHARED[2:])
        assert drafted(engine, [301, 302, 303], scope, stage="x", **config) == [999]  # the base's union
        assert drafted(engine, SECRET[:3], scope, stage="x", **config) == []
    # A's stage tree is its own and the base's; its union, every base stage and its own
    assert copies(drafted(engine, SHARED[:2], "tA", **config), SHARED[2:])
    assert copies(drafted(engine, SECRET[:3], "tA", stage="x", **config), SECRET[3:])


def test_a_scoped_requests_output_joins_its_scope_and_the_trees_keep_scopes_on_disk(tmp_path):
    engine = SuffixEngine()
    engine.start_request("a", [1, 2, 3], stage="s", scope="tA")
    engine.extend("a", SECRET)
    engine.finish_request("a")
    assert {split_stage(k) for k in engine.stats()["stages"]} == {("s", "tA"), ("s", None)}
    assert engine.document_ids("s", "tA") and not engine.document_ids("s")
    engine.save(tmp_path / "trees.idx")
    loaded = SuffixEngine.load(tmp_path / "trees.idx")
    loaded.check_integrity()
    assert drafted(loaded, SECRET[:3], "tA", config=SpecConfig(tree=False)) == SECRET[3:]
    assert drafted(loaded, SECRET[:3], "tB") == []
    # a scope with nothing left frees its slot, and then its (empty) base's
    loaded.remove_document(loaded.document_ids("s", "tA")[0])
    loaded.add_document([5, 6], stage="t", scope="tB")  # reuses a freed slot
    loaded.check_integrity()
    assert {split_stage(k) for k in loaded.stats()["stages"]} == {("t", "tB"), ("t", None)}


def test_names_that_cannot_be_a_scope_are_refused():
    engine = SuffixEngine()
    for bad in ("s\x1fx", ""):
        with pytest.raises(ValueError):
            engine.add_document([1, 2], stage=bad)
    with pytest.raises(ValueError):
        engine.start_request("r", [1, 2], stage="s", scope="a\x1fb")
    assert scoped_stage("s", None) == "s" and split_stage(scoped_stage("s", "tA")) == ("s", "tA")


def test_the_budget_evicts_from_the_scope_holding_most():
    """Tenant A floods the trees: its oldest outputs go, the base's and tenant B's stay."""
    engine = SuffixEngine(memory_budget_bytes=120_000)
    engine.add_document(SHARED, stage="s")
    engine.add_document(SECRET, stage="s", scope="tB")
    for n in range(400):
        engine.add_document([n % 50 + 1000 + k for k in range(40)] + [n], stage="s", scope="tA")
    engine.check_integrity()
    assert engine.stats()["evicted_documents"] > 0
    assert len(engine.document_ids("s")) == 1 and len(engine.document_ids("s", "tB")) == 1
    assert engine.document_ids("s", "tA")[-1] == max(engine.document_ids())  # A keeps its newest
    # with one scope it is the oldest first, as before tenants
    single = SuffixEngine(memory_budget_bytes=60_000)
    ids = [single.add_document([n + 2000 + k for k in range(40)], stage=f"s{n % 3}") for n in range(300)]
    kept = single.document_ids()
    assert kept == ids[-len(kept):]


# ---------------------------------------------------------------------------- the trace store
@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_recorded_calls_keep_their_tenant_and_older_calls_are_the_bases(db):
    with TraceStore(db) as store:  # imported (no tenant)
        store.write_sessions([Session("imported", "test", [Call([{"role": "user", "content": "q"}], "old")])],
                             stage_of=lambda _s, c: "s")
    recorder = Recorder(db)
    for tenant in ("tA", "tB", None):
        recorder.submit(RecordedCall(stage="s", session_id="same-session", model="m",
                                     messages=[{"role": "user", "content": f"q {tenant}"}], response=f"for {tenant}",
                                     tenant=tenant))
    recorder.close()
    with TraceStore(db) as store:
        assert {c.response: c.tenant for c in store.iter_calls()} == {"old": None, "for tA": "tA", "for tB": "tB",
                                                                      "for None": None}
        assert [c.response for c in store.iter_calls(tenant="tA")] == ["for tA"]
        assert sorted(c.response for c in store.iter_calls(tenant=BASE)) == ["for None", "old"]
        # one client session id under two keys is two sessions: no tenant's calls join another's
        assert len({c.session_id for c in store.iter_calls() if c.response.startswith("for")}) == 3


def test_parse_tenant_takes_a_digest_base_or_a_key():
    assert parse_tenant("base") == BASE
    assert parse_tenant(tenant_of("sk-1")) == tenant_of("sk-1") == parse_tenant("sk-1")


def write_calls(db, tok) -> None:
    with TraceStore(db) as store:
        store.write_sessions([Session("k", "test", [
            Call([{"role": "user", "content": "q1"}], "the base's answer", stage="s"),
            Call([{"role": "user", "content": "q2"}], "tenant A's secret answer", stage="s", tenant="tA")])],
            stage_of=lambda _s, c: c.stage, tokenize=(tok.fingerprint, tok.encode_batch))


def test_seeding_and_following_put_each_call_in_its_tenants_trees(db, tok):
    write_calls(db, tok)
    with TraceStore(db) as store:
        scoped, shared = SuffixEngine(), SuffixEngine()
        seed_from_store(scoped, store, tok, scoped=True)
        seed_from_store(shared, store, tok)
    assert {split_stage(k) for k in scoped.stats()["stages"]} == {("s", None), ("s", "tA")}
    assert set(shared.stats()["stages"]) == {"s"} and len(shared.document_ids("s")) == 2
    follower = StoreFollower(SuffixEngine(), db, tok, after=0, scoped=True).open()
    follower.engine.note_use("s", "tA")  # it serves tenant A (it reads the base's calls and A's)
    try:
        assert follower.step() == 2
        assert len(follower.engine.document_ids("s", "tA")) == 1 and len(follower.engine.document_ids("s")) == 1
    finally:
        follower.close()


def test_a_snapshot_is_used_only_by_a_server_that_scopes_as_it_did(db, tok, tmp_path):
    write_calls(db, tok)
    path = tmp_path / "trees.idx"
    engine = SuffixEngine()
    _, follower = seed_then_follow(engine, db, tok, snapshot=path, scoped=False)
    follower.close()  # saves the snapshot: shared trees
    report, follower = seed_then_follow(SuffixEngine(), db, tok, snapshot=path, scoped=True)
    follower.close()
    assert report.snapshot is None and "shared" in report.snapshot_refused
    assert snapshots.read_info(path).scoped  # the scoped server saved its own at close
    report, follower = seed_then_follow(SuffixEngine(), db, tok, snapshot=path, scoped=True)
    follower.close()
    assert report.snapshot is not None


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_store_tools_select_a_tenant_and_export_keeps_it(tmp_path, tok):
    db = tmp_path / "t.db"
    write_calls(db, tok)
    stats = cli("traces", "stats", "--db", str(db))
    assert stats.returncode == 0 and "calls per tenant" in stats.stdout and "tA" in stats.stdout
    only = cli("traces", "stats", "--db", str(db), "--tenant", "base")
    assert only.returncode == 0 and "calls per tenant" not in only.stdout
    out = tmp_path / "a.jsonl"
    exported = cli("export-traces", "--db", str(db), "--out", str(out), "--tenant", tenant_of("sk-nobody"))
    assert exported.returncode == 0 and "wrote 0 calls" in exported.stdout
    with TraceStore(db) as store:  # a tenant as the proxy names one: a digest
        store.conn.execute("UPDATE call_tenants SET tenant = ?", (tenant_of("sk-a"),))
    assert cli("export-traces", "--db", str(db), "--out", str(out), "--tenant", "sk-a").returncode == 0
    assert len(out.read_text().splitlines()) == 1
    again = tmp_path / "again.db"
    assert cli("import-traces", str(out), "--db", str(again)).returncode == 0
    with TraceStore(again) as store:
        assert [(c.response, c.tenant) for c in store.iter_calls()] == [("tenant A's secret answer", tenant_of("sk-a"))]


def test_an_empty_key_is_refused_at_start():
    """An unset variable (`--api-key "$KEY"`) must not become a key that `Bearer ` alone matches."""
    for option in ("--api-key", "--admin-key"):
        out = cli("serve", "--backend", "openai", "--upstream", "http://127.0.0.1:9", option, " ")
        assert out.returncode == 2 and "an empty key" in out.stderr, out.stderr
