"""Trace store and importers: fixtures of every OpenHands shape, malformed inputs, round trips."""

import json
import sqlite3
from pathlib import Path

import pytest
from traces_fixtures import (
    write_mock_pairs,
    write_output_jsonl,
    write_sdk_conversation,
    write_sdk_log,
    write_v0_logs,
)

from agentaccel.text.messages import calls_text
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.export import export_calls
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def run(paths, db, tok=None, **kw):
    with TraceStore(db) as store:
        return import_traces(list(paths), store, tokenizer=tok, **kw)


def all_calls(db, **filters):
    with TraceStore(db) as store:
        return list(store.iter_calls(**filters))


def test_openhands_v0_logs_use_what_the_model_saw(tmp_path, tok, db):
    replies = write_v0_logs(tmp_path / "logs" / "completions" / "session-1", n=3, prompt_mode=True)
    report = run([tmp_path / "logs"], db, tok)
    calls = all_calls(db)
    assert [c.response for c in calls] == replies  # `response`, not the converted fncall_response
    assert {c.stage for c in calls} == {"openhands:CodeActAgent"}  # from the metadata tag
    assert len({c.session_id for c in calls}) == 1
    assert [len(c.messages) for c in calls] == [2, 4, 6]
    assert calls[0].messages[0]["content"].startswith("You are OpenHands")
    assert report.rows[("openhands-completion", "openhands:CodeActAgent")].calls == 3


def test_openhands_sdk_log_prefers_raw_view(tmp_path, tok, db):
    raw = write_sdk_log(tmp_path / "sdk.json", prompt_mode=True)
    run([tmp_path / "sdk.json"], db, tok)
    (call,) = all_calls(db)
    assert call.response == raw
    assert call.stage == "openhands:condenser"
    assert "tools described in text" in call.messages[-1]["content"]
    write_sdk_log(tmp_path / "native.json", prompt_mode=False)
    run([tmp_path / "native.json"], tmp_path / "n.db", tok)
    (native,) = all_calls(tmp_path / "n.db")
    assert native.tool_calls[0]["function"]["name"] == "execute_bash"
    assert "execute_bash" in native.response  # tool calls count as produced text
    # the SDK's own tag: litellm_extra_body={"tags": [...]} is logged as kwargs.extra_body
    log = json.loads((tmp_path / "native.json").read_text())
    log["kwargs"] = {"extra_body": {"tags": ["agent:CodeActAgent"]}}
    (tmp_path / "tagged").mkdir()
    (tmp_path / "tagged" / "log.json").write_text(json.dumps(log))
    run([tmp_path / "tagged"], tmp_path / "t2.db", tok)
    assert [c.stage for c in all_calls(tmp_path / "t2.db")] == ["openhands:CodeActAgent"]


def test_openhands_output_jsonl(tmp_path, tok, db):
    """Rebuilt as OpenHands builds the prompt (tests/test_openhands.py checks it against a real
    run): the system prompt, one assistant message per response with all its tool calls, each
    output as a tool message with its exit code, the finish as its call's response."""
    responses = write_output_jsonl(tmp_path / "output.jsonl", instances=2)
    run([tmp_path / "output.jsonl"], db, tok)
    calls = all_calls(db)
    assert len(calls) == responses == 6  # the response shared by two actions counts once
    first, second, last = calls[:3]
    assert first.messages == [{"role": "system", "content": "You are OpenHands agent."},
                              {"role": "user", "content": "Solve issue 0"}]
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in second.messages[2]["tool_calls"]] == ["k0-c1", "k0-c2"]
    assert second.messages[3]["tool_call_id"] == "k0-c1" and second.messages[3]["content"].startswith("setup.py")
    assert last.messages[-1]["content"].endswith("[Command finished with exit code 1]")
    assert last.tool_calls[0]["function"]["name"] == "finish" and last.stage == "openhands:CodeActAgent"
    assert len({c.session_id for c in calls}) == 2 and not any((c.metadata or {}).get("approximate") for c in calls)


def test_format_detection_does_not_depend_on_how_long_the_first_record_is(tmp_path, tok, db):
    """A real evaluation output.jsonl's first line can be megabytes long (a window over it used to
    see no `history` key and skip the file); JSON files are judged by their first record's keys."""
    responses = write_output_jsonl(tmp_path / "output.jsonl", instances=2)
    rows = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    for row in rows:  # a long, escape-heavy first key, as a real instance's metadata can be
        row["instance"] = {"problem_statement": 'a \\"quoted\\" line\n' * 60_000}
        row["history"] = row.pop("history")  # after it
    (tmp_path / "output.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len((tmp_path / "output.jsonl").read_text().split("\n", 1)[0]) > 1 << 20
    run([tmp_path / "output.jsonl"], db, tok)
    assert len(all_calls(db)) == responses
    # a long chat JSONL record and a completion log whose first value is long: the same
    long = "x" * (1 << 17)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"id": long, "messages": [{"role": "user", "content": "q"},
                                                                             {"role": "assistant", "content": "a"}]}))
    write_sdk_log(tmp_path / "sdk.json", prompt_mode=False)
    log = json.loads((tmp_path / "sdk.json").read_text())
    (tmp_path / "sdk.json").write_text(json.dumps({"context_window": long, **log}))
    from agentaccel.traces.formats.registry import file_format

    assert file_format(tmp_path / "chat.jsonl") == "chat-jsonl"
    assert file_format(tmp_path / "sdk.json") == "openhands-completion"


def test_openhands_sdk_conversation_folder(tmp_path, tok, db):
    write_sdk_conversation(tmp_path / "conversations")
    write_sdk_conversation(tmp_path / "tagged", conversation_id="c2", tags=["agent:CodeActAgent"],
                           dynamic_context="<CURRENT_DATETIME>\n2026-11-26T01:58:13Z\n</CURRENT_DATETIME>")
    report = run([tmp_path], db, tok)
    assert not report.skipped_files and not [s for s in report.unrecognized if "events" in str(s.path)]
    calls = all_calls(db, stage="openhands:Agent")
    assert len(calls) == 2  # two responses: two tool calls in one, then finish
    first, second = calls
    assert [m["role"] for m in first.messages] == ["system", "user"]
    # the response as the proxy records one: its text, then its calls
    assert first.response == "Creating it." + calls_text(first.tool_calls)
    assert [c["function"]["name"] for c in first.tool_calls] == ["terminal"] * 2
    assert json.loads(first.tool_calls[1]["function"]["arguments"]) == {"command": "cat hello.txt"}
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert second.messages[-1] == {"role": "tool", "tool_call_id": "call_2", "content": "hello"}
    assert second.tool_calls[0]["function"]["name"] == "finish"
    tagged = all_calls(db, stage="openhands:CodeActAgent")
    assert len(tagged) == 2  # the LLM's tags name the stage
    # the system message the model was sent: the prompt, then the conversation's dynamic context
    assert first.messages[0]["content"] == "You are OpenHands."
    assert tagged[0].messages[0]["content"] == ("You are OpenHands."
                                                "<CURRENT_DATETIME>\n2026-11-26T01:58:13Z\n</CURRENT_DATETIME>")
    assert run([tmp_path], db, tok).calls == 0  # re-imports add nothing


def test_rsl_sql_flat_layout(tmp_path, tok, db):
    """RSL-SQL's published Spider results: one folder, LLM.json beside step_N_sql.txt files."""
    run_folder = tmp_path / "spider_test" / "gpt-4o"
    run_folder.mkdir(parents=True)
    (run_folder / "LLM.json").write_text(json.dumps([{"tables": ["singer"], "columns": ["singer.name"]}] * 3))
    (run_folder / "example.json").write_text(json.dumps([{"question": "few-shot", "sql": "SELECT 1"}] * 3))
    for step in (1, 2, 3, 4):
        (run_folder / f"step_{step}_sql.txt").write_text("".join(f"SELECT name FROM singer -- {step}.{n}\n"
                                                                 for n in range(3)))
    report = run([tmp_path], db, tok)
    assert {stage for _, stage in report.rows} == {"rsl-sql:schema-linking", "rsl-sql:preliminary-sql",
                                                   "rsl-sql:augmented-sql", "rsl-sql:binary-selection",
                                                   "rsl-sql:self-correction"}
    final = all_calls(db, stage="rsl-sql:self-correction")
    assert [c.response for c in final] == [f"SELECT name FROM singer -- 4.{n}" for n in range(3)]
    assert len({c.session_id for c in all_calls(db)}) == 3  # one session per question
    (run_folder / "step_4_sql.txt").write_text("SELECT 1\n")  # steps that disagree are refused, not guessed
    report = run([tmp_path], tmp_path / "u.db", tok)
    assert report.skipped_files and "disagree" in report.skipped_files[0][1]


def test_openhands_mock_pairs(tmp_path, tok, db):
    write_mock_pairs(tmp_path / "CodeActAgent" / "test_write_file", n=3)
    run([tmp_path], db, tok)
    calls = all_calls(db)
    assert [c.response for c in calls] == [f"<execute_ipython>\nprint({i})\n</execute_ipython>" for i in (1, 2, 3)]
    assert {c.stage for c in calls} == {"openhands:CodeActAgent"}


def test_chat_jsonl_stage_tags_and_validation(tmp_path, tok, db):
    rows = [
        {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "SELECT 1"}],
         "stage": "sql"},
        {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "yes"}],
         "metadata": {"tags": ["agent:condenser"]}},
        {"messages": [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "plain"}]},
    ]
    path = tmp_path / "calls.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    run([path], db, tok)
    assert sorted(c.stage for c in all_calls(db)) == ["default", "openhands:condenser", "sql"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    report = run([bad], db, tok)
    assert report.skipped_files and "last message must be the assistant" in report.skipped_files[0][1]
    assert len(all_calls(db)) == 3  # the bad file wrote nothing, not even its good line


@pytest.mark.parametrize(
    "name, content, reason",
    [
        ("truncated.traj", b'{"history": [{"role": "user", "content": "hi"}', "invalid JSON"),
        ("binary.jsonl", b"\x00\x01\x02\x03" * 100, "binary file"),
        ("empty.jsonl", b"", "empty file"),
        ("latin1.jsonl", '{"messages": "caf\xe9"}'.encode("latin-1"), "UTF-8"),
        ("nohistory.traj", b'{"trajectory": []}', "history"),
        ("badline.jsonl", b'{"messages": [{"role": "assistant", "content": "a"}]}\n{oops\n', "line 2"),
        ("huge.traj", b'{"history": []}' + b" " * 5000, "over the 4,096-byte limit"),
    ],
    ids=["truncated", "binary", "empty", "not-utf8", "no-history", "bad-line", "huge"],
)
def test_malformed_files_are_skipped_with_a_reason(tmp_path, tok, name, content, reason, db):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}))
    (tmp_path / name).write_bytes(content)
    skipped = []
    report = run([tmp_path], db, tok, max_file_bytes=4096, on_skip=lambda p, r: skipped.append((p, r)))
    assert [(p.name, reason in r) for p, r in skipped] == [(name, True)], skipped
    assert report.calls == 1 and len(all_calls(db)) == 1


def test_missing_path_and_unknown_files(tmp_path, db):
    skipped = []
    (tmp_path / "README.md").write_text("# not a trace")
    (tmp_path / "odd.jsonl").write_text('{"hello": 1}\n')
    (tmp_path / "src").mkdir()
    for name in ("README.md", "odd.jsonl"):
        (tmp_path / name).rename(tmp_path / "src" / name)
    report = run([tmp_path / "nope", tmp_path / "src"], db,
                 on_skip=lambda p, r: skipped.append((p.name, r)))
    assert skipped == [("nope", "no such file or folder"), ("odd.jsonl", "not in any known trace format")]
    assert [s.path.name for s in report.unrecognized] == ["README.md"]


def test_not_a_database_gives_a_clear_error(tmp_path):
    bad = tmp_path / "t.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ValueError, match="not a usable trace store"):
        TraceStore(bad)


def test_export_then_import_round_trip(tmp_path, tok, db, new_store):
    write_v0_logs(tmp_path / "logs" / "s1", n=4)
    write_output_jsonl(tmp_path / "output.jsonl")
    run([tmp_path / "logs", tmp_path / "output.jsonl"], db, tok)
    out = tmp_path / "export.jsonl"
    with TraceStore(db) as store:
        assert export_calls(store, out) == 10
    again = run([out], db, tok)  # same store: nothing new
    assert again.calls == 0 and sum(r.skipped for r in again.rows.values()) == 10
    fresh = new_store()
    run([out], fresh, tok)  # fresh store: the same calls
    key = lambda c: (c.stage, c.response, json.dumps(c.messages))  # noqa: E731
    assert sorted(map(key, all_calls(fresh))) == sorted(map(key, all_calls(db)))


def test_dry_run_writes_nothing(tmp_path, tok):
    write_v0_logs(tmp_path / "logs" / "s1", n=2)
    report = import_traces([tmp_path / "logs"], None, tokenizer=tok)
    assert report.calls == 2 and sum(r.tokens for r in report.rows.values()) > 0
    assert not (tmp_path / "t.db").exists()


def test_prompt_tokens_are_the_rendered_prompt(tmp_path, tok, db):
    """Cached per-message segments, back to back, tokenize exactly like the whole rendered prompt."""
    from agentaccel.text.render import render_message

    write_v0_logs(tmp_path / "logs" / "s1", n=3)
    run([tmp_path / "logs"], db, tok)
    with TraceStore(db) as store:
        for call in store.iter_calls():
            whole = tok.encode("".join(render_message(m) for m in call.messages))
            assert store.prompt_tokens(call.id, tok.fingerprint).tolist() == whole
            (ids,) = store.response_tokens([call.id], tok.fingerprint).values()
            assert ids.tolist() == tok.encode(call.response)


def test_store_is_wal_and_queries_filter(tmp_path, tok, db):
    write_v0_logs(tmp_path / "logs" / "s1", n=3)
    write_sdk_log(tmp_path / "sdk.json")
    run([tmp_path], db, tok)
    if isinstance(db, Path):  # SQLite: readers never wait for the writer
        assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with TraceStore(db) as store:
        assert store.counts_by_stage() == {"openhands:CodeActAgent": {"calls": 3, "sessions": 1},
                                           "openhands:condenser": {"calls": 1, "sessions": 1}}
        times = [c.created_at for c in store.iter_calls()]
        assert times == sorted(times)
        assert [c.created_at for c in store.iter_calls(stage="openhands:CodeActAgent", newest_first=True)] == sorted(
            [t for t in times if t < 1_700_000_100], reverse=True)
        assert len(list(store.iter_calls(since=1_700_000_001, until=1_700_000_100))) == 2
        store.check()


def test_render_prompt_with_the_model_chat_template(tok):
    from agentaccel.text.render import GENERATION_PROMPT, render_message, render_prompt

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = render_prompt(messages)
    assert plain == "".join(render_message(m) for m in messages) + GENERATION_PROMPT
    templated = render_prompt(messages, tok.chat_template)
    assert templated == plain  # SmolLM2's template is ChatML: the documented plain template
    assert render_prompt(messages[1:], tok.chat_template).startswith("<|im_start|>system\nYou are a helpful")
    assert render_prompt(messages, "{{ broken") == plain  # a template that cannot run falls back
    # content as a list of parts (OpenHands sends these): the template sees their text joined
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert render_prompt(parts, tok.chat_template) == templated


def test_claude_code_and_codex_logs_rebuild_each_call_as_the_model_saw_it(tmp_path):
    """Each model call of a Claude Code transcript (its blocks' entries joined into one message) and
    of a Codex rollout, its prompt the turns before it in chat form; Claude Code's own synthetic
    messages are no call; a broken line fails the file, naming the line."""
    from format_fixtures import FIXTURES

    from agentaccel.traces.formats import claude_code, codex
    from agentaccel.traces.records import FormatError

    [session] = claude_code.parse_transcript(FIXTURES["claude-code"](tmp_path))
    first, second = session.calls
    assert first.messages == [{"role": "user", "content": "Fix add in calc.py"},
                              {"role": "system", "content": "<system-reminder>Today is Monday.</system-reminder>"}]
    assert first.response.startswith("Reading it.") and first.tool_calls[0]["function"] == \
        {"name": "Read", "arguments": '{"file_path": "calc.py"}'}
    assert [m["role"] for m in second.messages] == ["user", "system", "assistant", "tool"]
    assert second.messages[2]["tool_calls"] == first.tool_calls and second.messages[3]["tool_call_id"] == "toolu_1"
    assert second.response == "add returns a - b: fixed." and {c.stage for c in session.calls} == {"claude-code"}

    [session] = codex.parse_rollout(FIXTURES["codex-rollout"](tmp_path))
    first, second = session.calls
    assert first.messages == [{"role": "system", "content": "You are Codex."},
                              {"role": "system", "content": "Be careful."},
                              {"role": "user", "content": "Fix add in calc.py"}]
    assert first.tool_calls == [{"id": "call_1", "type": "function",
                                 "function": {"name": "exec_command", "arguments": '{"cmd": "cat calc.py"}'}}]
    assert [m["role"] for m in second.messages] == ["system", "system", "user", "assistant", "tool"]
    assert second.response == "Fixed." and {c.stage for c in session.calls} == {"codex"}

    broken = tmp_path / "broken.jsonl"
    broken.write_text(FIXTURES["claude-code"](tmp_path / "again").read_text() + '{"uuid": "cut\n')
    with pytest.raises(FormatError, match="line 9"):
        claude_code.parse_transcript(broken)
