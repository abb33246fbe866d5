"""Every format `import-traces` reads: imported, then each call sent to `serve --backend replay`
as the agent would send it (its prompt, its stage, the recorded session named in
X-Agentaccel-Session, the recorded model) is answered with that call's own recording, never another's; and export ->
import gives the same calls. On the fixtures of every format, and on the real traces of
../shared/traces where they are present (every call, through the lookup; a sample over HTTP)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from format_fixtures import FIXTURES
from servers import ServerThread

from agentaccel.backends.replay import ReplayBackend
from agentaccel.backends.replay.recordings import Recordings
from agentaccel.bench.corpus import default_traces_dir
from agentaccel.engine.cost import parse
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.text.messages import normalized, reply_content
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.export import export_calls
from agentaccel.traces.formats.registry import PARSERS, discover
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def every_format(tmp_path_factory, tok):
    """One store holding a fixture of every format."""
    root = tmp_path_factory.mktemp("formats")
    sources = {fmt: build(root / fmt.replace("-", "_")) for fmt, build in FIXTURES.items()
               if (root / fmt.replace("-", "_")).mkdir() is None}
    db = root / "all.db"
    with TraceStore(db) as store:
        import_traces(list(sources.values()), store, tokenizer=tok)
    return sources, db


def test_every_format_has_a_fixture_that_is_read_as_that_format(every_format):
    sources, _ = every_format
    assert set(FIXTURES) == set(PARSERS), "a format without a fixture here: add one to tests/format_fixtures.py"
    for fmt, path in sources.items():
        assert {s.format for s in discover([path])} == {fmt}, (fmt, [(s.path, s.format) for s in discover([path])])


def calls_with_keys(db):
    with TraceStore(db) as store:
        keys = store.session_keys()
        return [(call, keys[call.session_id]) for call in store.iter_calls()]


def replay_all(db, calls) -> list[str]:
    """Each call's prompt through the replay server; the calls answered otherwise than recorded."""
    wrong = []
    with TraceStore(db) as store:
        backend = ReplayBackend(store, load_tokenizer(), parse("gpu"), step_ms=0.0, speculate=False)
    with ServerThread(create_app(ProxyConfig(record=False), backend)) as server, httpx.Client(timeout=120) as http:
        for call, session in calls:
            body = {"model": call.model or "replay", "messages": call.messages, "temperature": 0}
            r = http.post(server.url + "/v1/chat/completions", json=body,
                          headers={"x-agentaccel-session": session, "x-agentaccel-stage": call.stage})
            message = r.json()["choices"][0]["message"] if r.status_code == 200 else {}
            if r.status_code != 200 or (message.get("content") or "") != reply_content(call.response, call.tool_calls) \
                    or [normalized({"tool_calls": message.get("tool_calls")})] != \
                    [normalized({"tool_calls": call.tool_calls})]:
                wrong.append(f"call {call.id} ({call.stage}): {r.status_code} {r.text[:300]}")
        counts = httpx.get(server.url + "/metrics").text
    assert "agentaccel_replay_lookups_total" in counts
    return wrong


def test_each_call_of_every_format_is_answered_with_its_own_recording(every_format):
    _, db = every_format
    calls = calls_with_keys(db)
    assert len(calls) > 30
    assert replay_all(db, calls) == []


def same_calls(db) -> list[tuple]:
    with TraceStore(db) as store:
        return sorted((c.stage, c.response, json.dumps([normalized(m) for m in c.messages]),
                       json.dumps(c.tool_calls)) for c in store.iter_calls())


def test_export_then_import_gives_the_same_calls_for_every_format(every_format, tmp_path, tok):
    sources, _ = every_format
    for fmt, path in sources.items():
        first, again = tmp_path / f"{fmt}.db", tmp_path / f"{fmt}-again.db"
        with TraceStore(first) as store:
            import_traces([path], store, tokenizer=tok)
            exported = tmp_path / f"{fmt}.jsonl"
            assert export_calls(store, exported) > 0, fmt
        with TraceStore(again) as store:
            import_traces([exported], store, tokenizer=tok)
        assert same_calls(again) == same_calls(first), fmt


try:
    TRACES = default_traces_dir()
except FileNotFoundError:
    TRACES = None


@pytest.mark.slow
@pytest.mark.skipif(TRACES is None, reason="../shared/traces is not present")
def test_every_call_of_the_real_traces_is_answered_with_its_own_recording(tmp_path, tok):
    db = tmp_path / "real.db"
    with TraceStore(db) as store:
        report = import_traces([TRACES], store, tokenizer=tok)
        recordings = Recordings(store)
    formats = {fmt for fmt, _stage in report.rows}
    assert len(formats) >= 8, formats
    calls = calls_with_keys(db)
    wrong = [call.id for call, session in calls
             if (found := _match(recordings, call, session)) is None or found.response != call.response]
    assert not wrong, f"{len(wrong)} of {len(calls)} calls answered by another recording or none: {wrong[:20]}"
    by_stage: dict[str, list] = {}
    for item in calls:
        by_stage.setdefault(item[0].stage, []).append(item)
    sample = [x for items in by_stage.values() for x in random.Random(0).sample(items, min(5, len(items)))]
    assert replay_all(db, sample) == []


def _match(recordings, call, session):
    try:
        return recordings.match(call.messages, session, call.model, call.stage)
    except Exception:  # noqa: BLE001 - counted as not answered by its own recording
        return None
