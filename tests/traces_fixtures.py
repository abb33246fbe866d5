"""Builders of trace files in the documented shapes (OpenHands V0/SDK completion logs,
evaluation output.jsonl, mock prompt/response pairs) for tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SYSTEM = {"role": "system", "content": "You are OpenHands agent, a helpful AI assistant."}


def model_response(content, tool_calls=None, rid="chatcmpl-1", model="gpt-4o"):
    return {
        "id": rid, "model": model, "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "tool_calls" if tool_calls else "stop",
                     "message": {"role": "assistant", "content": content, "tool_calls": tool_calls}}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 17, "total_tokens": 137},
    }


def write_v0_logs(folder: Path, n: int = 3, prompt_mode: bool = False) -> list[str]:
    """V0 per-call completion logs; in prompt mode `fncall_*` hold the converted view."""
    folder.mkdir(parents=True, exist_ok=True)
    replies = []
    history = [SYSTEM, {"role": "user", "content": "Fix the failing test in utils.py"}]
    for i in range(n):
        reply = f"<execute_bash>\npytest tests/test_utils.py -k case{i}\n</execute_bash>"
        replies.append(reply)
        record = {
            "messages": history, "response": model_response(reply, rid=f"r{i}"),
            "args": [], "kwargs": {"metadata": {"tags": ["agent:CodeActAgent", "web_host:x"]}},
            "timestamp": 1_700_000_000.0 + i, "cost": 0.001,
        }
        if prompt_mode:
            record["fncall_messages"] = [{"role": "user", "content": "converted view"}]
            call = {"id": "t", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
            record["fncall_response"] = model_response(None, tool_calls=[call])
        (folder / f"{1_700_000_000 + i}.json").write_text(json.dumps(record))
        history = [*history, {"role": "assistant", "content": reply}, {"role": "user", "content": f"obs {i}"}]
    return replies


def write_sdk_log(path: Path, prompt_mode: bool = True) -> str:
    tool_call = {"id": "call_1", "type": "function",
                 "function": {"name": "execute_bash", "arguments": "{\"command\": \"ls\"}"}}
    record = {
        "messages": [SYSTEM, {"role": "user", "content": "List files"}],
        "tools": [{"type": "function", "function": {"name": "execute_bash"}}],
        "kwargs": {"metadata": {"tags": ["agent:condenser"]}},
        "response": model_response(None, tool_calls=[tool_call]),
        "cost": 0.0, "timestamp": 1_700_000_100.0, "latency_sec": 1.25,
        "usage_summary": {"prompt_tokens": 50}, "context_window": 128000,
    }
    raw_text = "I will list the files.\n<function=execute_bash>\n<parameter=command>ls</parameter>\n</function>"
    if prompt_mode:
        record["raw_messages"] = [SYSTEM, {"role": "user", "content": "List files (tools described in text)"}]
        record["raw_response"] = model_response(raw_text)
    path.write_text(json.dumps(record))
    return raw_text


def tool_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def classic_history(k: int = 0) -> list[dict]:
    """A classic OpenHands run as its events serialize (event_to_dict, openhands-ai 0.62): the system
    prompt with its tools, the task, a state change, a recall with nothing in it, one response calling
    two commands, their outputs, a command that fails, an error, the finish."""
    def ev(**fields):
        return {"timestamp": "2024-11-01T10:00:00", **fields}

    def run(call_id, command, response, source="agent"):
        return ev(source=source, action="run", message=f"Running command: {command}",
                  args={"command": command, "is_input": False, "thought": "", "blocking": False},
                  tool_call_metadata={"function_name": "execute_bash", "tool_call_id": call_id,
                                      "model_response": response, "total_calls_in_response": 2})

    def output(call_id, cause, content, exit_code=0):
        return ev(source="agent", observation="run", cause=cause, content=content,
                  message=f"Command `x` executed with exit code {exit_code}.",
                  tool_call_metadata={"function_name": "execute_bash", "tool_call_id": call_id},
                  extras={"command": "x", "metadata": {"exit_code": exit_code, "pid": -1, "username": "root",
                                                       "hostname": "h", "working_dir": "/workspace",
                                                       "py_interpreter_path": "/usr/bin/python",
                                                       "prefix": "", "suffix": ""}, "hidden": False})

    tools = [{"type": "function", "function": {"name": "execute_bash"}}, {"type": "function",
                                                                           "function": {"name": "finish"}}]
    both = model_response("Let me look.", rid=f"k{k}-r0", tool_calls=[
        tool_call(f"k{k}-c1", "execute_bash", {"command": "ls"}),
        tool_call(f"k{k}-c2", "execute_bash", {"command": "cat setup.py"})])
    failing = model_response("", rid=f"k{k}-r1", tool_calls=[tool_call(f"k{k}-c3", "execute_bash",
                                                                      {"command": "pytest"})])
    done = model_response("All tests pass.", rid=f"k{k}-r2", tool_calls=[tool_call(f"k{k}-c4", "finish",
                                                                                 {"message": "Fixed."})])
    events = [
        ev(source="agent", action="system", message="You are OpenHands agent.",
           args={"content": "You are OpenHands agent.", "tools": tools, "openhands_version": "0.62.0",
                 "agent_class": "CodeActAgent"}),
        ev(source="user", action="message", message=f"Solve issue {k}",
           args={"content": f"Solve issue {k}", "file_urls": [], "image_urls": [], "wait_for_response": False}),
        ev(source="environment", observation="agent_state_changed", content="", extras={"agent_state": "running"}),
        ev(source="user", action="recall", args={"recall_type": "workspace_context", "query": f"Solve issue {k}"}),
        ev(source="environment", observation="recall", content="Added workspace context", cause=3,
           extras={"recall_type": "workspace_context", "repo_name": "", "repo_directory": "", "date": "",
                   "runtime_hosts": {}, "microagent_knowledge": []}),
        run(f"k{k}-c1", "ls", both),
        run(f"k{k}-c2", "cat setup.py", both),
        output(f"k{k}-c1", 5, "setup.py\nsrc"),
        output(f"k{k}-c2", 6, "from setuptools import setup"),
        run(f"k{k}-c3", "pytest", failing),
        output(f"k{k}-c3", 9, "1 failed", exit_code=1),
        ev(source="agent", action="finish", message="Fixed.",
           args={"final_thought": "Fixed.", "outputs": {}, "thought": ""},
           tool_call_metadata={"function_name": "finish", "tool_call_id": f"k{k}-c4", "model_response": done,
                               "total_calls_in_response": 1}),
    ]
    for i, e in enumerate(events):
        e["id"] = i
    return events


def write_output_jsonl(path: Path, instances: int = 2) -> int:
    """An evaluation output.jsonl of classic runs (`classic_history`); returns the LLM calls in it."""
    path.write_text("".join(json.dumps({"instance_id": f"repo__issue-{k}", "history": classic_history(k),
                                        "metadata": {"model_name": "gpt-4o",
                                                     "llm_config": {"max_message_chars": 30000}}}) + "\n"
                            for k in range(instances)))
    return 3 * instances


def write_mock_pairs(folder: Path, n: int = 3) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(1, n + 1):
        (folder / f"prompt_{i:03d}.log").write_text(f"----------\nSYSTEM: flattened prompt {i}\n")
        (folder / f"response_{i:03d}.log").write_text(f"<execute_ipython>\nprint({i})\n</execute_ipython>")


def write_sdk_conversation(root: Path, conversation_id: str = "abe8c3ae170f4ffab59d7ddfcf9acfde",
                           tags: list[str] | None = None, dynamic_context: str | None = None) -> Path:
    """An OpenHands SDK conversation folder in the shape `Conversation(persistence_dir=...)` writes
    (events seen from openhands-sdk 1.58): a system prompt, the task, one response calling two
    tools, their observations, a finish call. `dynamic_context`: the system prompt event's second
    part, as the 1.x app's agent server writes it (the date and time, say). Returns the folder."""
    folder = root / conversation_id
    (folder / "events").mkdir(parents=True)
    llm = {"model": "litellm_proxy/m", "base_url": "http://127.0.0.1:8000", "usage_id": "agent",
           **({"litellm_extra_body": {"tags": tags}} if tags else {})}
    (folder / "base_state.json").write_text(json.dumps({"id": conversation_id, "agent": {"llm": llm, "kind": "Agent"},
                                                        "execution_status": "finished"}))
    text = lambda t: [{"cache_prompt": False, "type": "text", "text": t}]  # noqa: E731 - the SDK's content parts

    def action(rid, call_id, name, arguments, thought=""):
        return {"kind": "ActionEvent", "source": "agent", "thought": text(thought) if thought else [],
                "action": {"kind": "TerminalAction"}, "tool_name": name, "tool_call_id": call_id,
                "tool_call": {"id": call_id, "name": name, "arguments": json.dumps(arguments), "origin": "completion"},
                "llm_response_id": rid, "security_risk": "UNKNOWN"}

    def observation(call_id, name, output):
        return {"kind": "ObservationEvent", "source": "environment", "tool_name": name, "tool_call_id": call_id,
                "observation": {"content": text(output), "is_error": False, "kind": "TerminalObservation"}}

    events = [
        {"kind": "SystemPromptEvent", "source": "agent", "tools": [{"name": "terminal"}, {"name": "finish"}],
         "system_prompt": {"type": "text", "text": "You are OpenHands."},
         **({"dynamic_context": {"type": "text", "text": dynamic_context}} if dynamic_context else {})},
        {"kind": "MessageEvent", "source": "user", "llm_message": {"role": "user", "content": text("Make hello.txt")}},
        action("chatcmpl-0", "call_1", "terminal", {"command": "echo hello > hello.txt"}, thought="Creating it."),
        action("chatcmpl-0", "call_2", "terminal", {"command": "cat hello.txt"}),
        observation("call_1", "terminal", ""),
        observation("call_2", "terminal", "hello"),
        {"kind": "ConversationStateUpdateEvent", "source": "environment", "key": "execution_status",
         "value": "running"},
        action("chatcmpl-1", "call_3", "finish", {"message": "Done."}),
        observation("call_3", "finish", "Done."),
    ]
    for i, event in enumerate(events):
        event.update(id=f"e{i}", timestamp=f"2026-11-23T07:19:{i:02d}")
        (folder / "events" / f"event-{i:05d}-e{i}.json").write_text(json.dumps(event))
    (folder / "events" / ".eventlog.lock").write_text("")
    return folder


def chat_store(folder: Path, rows: list[dict]) -> Path:
    """A trace store holding `rows` (chat JSONL objects), imported as a user would: its path."""
    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.importer import import_traces
    from agentaccel.traces.store import TraceStore

    (folder / "calls.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    db = folder / "t.db"
    with TraceStore(db) as store:
        import_traces([folder / "calls.jsonl"], store, tokenizer=load_tokenizer())
    return db


def repetitive_store(tmp_path, n=30):
    """Chat calls whose outputs repeat with small changes (what agents do), in two stages."""
    rng = np.random.default_rng(0)
    words = ["SELECT", "name", "FROM", "users", "WHERE", "id", "=", "ORDER", "BY", "LIMIT"]
    rows = []
    for i in range(n):
        q = f"question {i} about table t{i % 3}"
        sql = " ".join(words[:6]) + f" = {i} " + " ".join(words[6:]) + f" {rng.integers(1, 9)}"
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": sql}],
                     "stage": "sql" if i % 2 else "other", "metadata": {"created_at": 1000.0 + i}})
    return chat_store(tmp_path, rows)
