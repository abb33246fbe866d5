"""Compacted sessions: after an agent compacts its context, each call's prompt is what the agent sent
from then on (the compaction's replacement and what followed it), never the turns it dropped. One
rule for Claude Code's transcripts and Codex's rollouts, each tested on a session compacted twice."""

import json

from agentaccel.text.dialects import responses
from agentaccel.traces.formats import claude_code, codex
from agentaccel.traces.formats.conversation import since_compaction


def _codex_line(kind, payload):
    return json.dumps({"timestamp": "2026-11-28T10:00:00.000Z", "type": kind, "payload": payload}) + "\n"


def _msg(role, text):
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def _call(n):
    return {"type": "function_call", "name": "exec_command", "arguments": json.dumps({"cmd": f"step {n}"}),
            "call_id": f"call_{n}"}


def _output(n):
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": f"out {n}"}


CONTEXT = [_msg("developer", "<permissions instructions>sandboxed</permissions instructions>"),
           _msg("user", "<environment_context>cwd=/work</environment_context>")]


def _rollout(tmp_path, replacements):
    """A session compacted twice: before the first compaction two calls, between the two one call,
    after the second one call. `replacements[k]` is the k-th `compacted` line's replacement history
    (None: the line has only its summary, as older Codex versions write it)."""
    lines = [_codex_line("session_meta", {"id": "r-2", "cli_version": "0.114.0",
                                          "base_instructions": {"text": "You are Codex."}})]
    items = [*CONTEXT, _msg("user", "Fix add in calc.py"), {"type": "reasoning", "summary": []}, _call(1),
             _output(1), _msg("assistant", "Fixed add."), _msg("user", "Now fix sub.")]
    lines += [_codex_line("response_item", it) for it in items]
    lines.append(_codex_line("compacted", {"message": "SUMMARY ONE", **(
        {"replacement_history": replacements[0]} if replacements[0] is not None else {})}))
    lines += [_codex_line("turn_context", {"model": "tiny"}),
              _codex_line("event_msg", {"type": "context_compacted"})]
    lines += [_codex_line("response_item", it) for it in (_call(2), _output(2), _msg("user", "And mul."))]
    lines.append(_codex_line("compacted", {"message": "SUMMARY TWO", **(
        {"replacement_history": replacements[1]} if replacements[1] is not None else {})}))
    lines += [_codex_line("response_item", it) for it in (_msg("assistant", "All three fixed."),)]
    lines.append(_codex_line("event_msg", {"type": "token_count"}))  # as Codex notes an answer's end
    path = tmp_path / "rollout-2026-11-28T10-00-00-r-2.jsonl"
    path.write_text("".join(lines))
    return path


def _sent(*items):
    """What the proxy records for a Responses request of these input items (Codex's instructions first)."""
    return responses.chat_messages("You are Codex.", list(items), strict=False)


def test_codex_calls_after_a_compaction_are_sent_its_replacement_history(tmp_path):
    """Recent Codex writes the history it continues from (`replacement_history`): the kept user
    turns, an encrypted compaction item (not shown to a chat model) and the context re-sent."""
    first = [_msg("user", "Fix add in calc.py"), _msg("user", "Now fix sub."),
             {"type": "compaction", "encrypted_content": "opaque-1"}]
    second = [_msg("user", "Now fix sub."), *CONTEXT, _msg("user", "And mul."),
              {"type": "compaction", "encrypted_content": "opaque-2"}]
    [session] = codex.parse_rollout(_rollout(tmp_path, [first, second]))
    calls = session.calls
    assert len(calls) == 4 and calls[1].response == "Fixed add."
    assert calls[1].messages[-1]["role"] == "tool"  # before any compaction: the whole history
    assert calls[2].messages == _sent(*first)
    assert calls[2].tool_calls[0]["id"] == "call_2"
    assert calls[3].messages == _sent(*second)
    assert calls[3].response == "All three fixed."
    assert not any("Fixed add." in json.dumps(m) for c in calls[2:] for m in c.messages)  # dropped turns stay dropped


def test_codex_compaction_without_a_replacement_rebuilds_it_from_the_summary(tmp_path):
    """Older Codex writes only the summary; it had sent the rollout's opening context, the user turns
    of the replaced history (not its own context turns, not an earlier summary) and the summary."""
    [session] = codex.parse_rollout(_rollout(tmp_path, [None, None]))
    calls = session.calls
    assert len(calls) == 4
    after_first = [*CONTEXT, _msg("user", "Fix add in calc.py"), _msg("user", "Now fix sub."),
                   _msg("user", "SUMMARY ONE")]
    assert calls[2].messages == _sent(*after_first)
    after_second = [*CONTEXT, _msg("user", "Fix add in calc.py"), _msg("user", "Now fix sub."),
                    _msg("user", "And mul."), _msg("user", "SUMMARY TWO")]
    assert calls[3].messages == _sent(*after_second)


def test_older_codex_keeps_only_the_newest_user_turns_that_fit(tmp_path):
    long_turn = "x" * (codex.KEPT_USER_TOKENS * 4 - 40)  # all but 10 tokens of the budget
    kept = codex._newest_within(["oldest", "y" * 400, long_turn], codex.KEPT_USER_TOKENS)
    assert kept[-1] == long_turn and len(kept) == 2 and "tokens truncated" in kept[0]
    assert kept[0].startswith("y" * 20) and len(kept[0]) < 100  # cut to the 10 tokens left


def _cc_entry(uuid, parent, kind, text=None, **extra):
    row = {"sessionId": "s-2", "version": "2.1.101", "isSidechain": False, "uuid": uuid, "parentUuid": parent,
           "type": kind, **extra}
    if kind in ("user", "assistant"):
        row["message"] = {"role": kind, "content": [{"type": "text", "text": text}],
                          **({"id": f"msg_{uuid}", "model": "tiny"} if kind == "assistant" else {})}
    return json.dumps(row) + "\n"


def _transcript(tmp_path, linked):
    """A Claude Code session compacted twice. `linked`: the boundaries also keep a parent link to the
    turn before them (the rule must not depend on the link being cut)."""
    def boundary(uuid, before):
        return _cc_entry(uuid, before if linked else None, "system", subtype="compact_boundary",
                         content="Conversation compacted", logicalParentUuid=before,
                         compactMetadata={"trigger": "auto", "preTokens": 1000})
    lines = [_cc_entry("u1", None, "user", "Fix add in calc.py"), _cc_entry("a1", "u1", "assistant", "Fixed add."),
             boundary("b1", "a1"),
             _cc_entry("s1", "b1", "user", "SUMMARY ONE", isCompactSummary=True, isVisibleInTranscriptOnly=True),
             _cc_entry("u2", "s1", "user", "Now fix sub."), _cc_entry("a2", "u2", "assistant", "Fixed sub."),
             boundary("b2", "a2"),
             _cc_entry("s2", "b2", "user", "SUMMARY TWO", isCompactSummary=True, isVisibleInTranscriptOnly=True),
             _cc_entry("u3", "s2", "user", "And mul."), _cc_entry("a3", "u3", "assistant", "Fixed mul.")]
    folder = tmp_path / ("linked" if linked else "cut")
    folder.mkdir()
    path = folder / "s-2.jsonl"
    path.write_text("".join(lines))
    return path


def test_claude_code_calls_after_a_compaction_start_from_its_summary(tmp_path):
    for linked in (False, True):
        [session] = claude_code.parse_transcript(_transcript(tmp_path, linked))
        prompts = [[[p["text"] for p in m["content"]] if isinstance(m["content"], list) else m["content"]
                    for m in c.messages] for c in session.calls]
        # the summary and the next user turn: one user turn, as the Messages API carried them
        assert prompts == [["Fix add in calc.py"], [["SUMMARY ONE", "Now fix sub."]],
                           [["SUMMARY TWO", "And mul."]]], (linked, prompts)
        assert all(m["role"] == "user" for c in session.calls for m in c.messages)
        assert [c.response for c in session.calls] == ["Fixed add.", "Fixed sub.", "Fixed mul."]


def test_one_rule_the_latest_compaction_and_what_follows_it():
    def replacement(entry, earlier):
        if isinstance(entry, tuple):  # ("compact", kept): keeps what `kept` picks of the replaced history
            return [*entry[1](earlier()), "summary"]
        return None
    keep_first = ("compact", lambda history: history[:1])
    assert since_compaction(["a", "b"], replacement) == ["a", "b"]
    assert since_compaction(["a", "b", keep_first, "c"], replacement) == ["a", "summary", "c"]
    # the second compaction replaces the history the first one left ("b", its summary, "c"), not the log
    assert since_compaction(["a", "b", ("compact", lambda h: h[1:]), "c", keep_first, "d"], replacement) == \
        ["b", "summary", "d"]
