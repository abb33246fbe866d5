"""Sessions longer than the model's window, as the real clients run them: Claude Code and Codex
(the pinned CLIs from npm, headless) and an OpenHands SDK agent with its summarizing condenser,
through `agentaccel serve --backend replay --context-window 8192` (the embedded model's window,
counted with its tokenizer), each set up as the config commands set it for that window. The task
makes the agent print the chapters of a book with its shell tool, one per turn: the whole
conversation is past the window, so each client must compact it (the model is asked for a
summary, and the session goes on from it) to finish. Claude Code compacts when the proxy answers
"prompt is too long", Codex before it gets there (its auto-compact limit), the OpenHands condenser
at its event count. The model's turns are replayed: at every turn a step (the next chapter, or the
final answer) and the summary the client may ask for there instead, and after each summary the
turns that go on from it (backends/replay/recordings.py finds them by the summary the client
carries). So wherever the client decides to compact, it is answered as a model would answer: the
client runs its tools, compacts, and finishes with the recorded answer, no 5xx and a 400 only past
the window, and its compaction calls are in the trace store with the summaries they got (Claude
Code's and Codex's in the client's stage, told by text/compaction.py; the condenser's in its own).
The parts alone, fast: the lookup, the recognised compactions, the window, `bench agent --ttft`.
"""

from __future__ import annotations

import difflib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from servers import ServerThread, serving

from agentaccel.adapters.agent_clients import CLAUDE_CODE, CODEX, claude_code_env, codex_config, environment, installed
from agentaccel.backends.replay import ReplayBackend
from agentaccel.backends.replay.recordings import NoRecording, Recordings
from agentaccel.bench.first_request import FirstRequest
from agentaccel.engine.cost import parse
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.proxy.apis.messages import MessagesApi
from agentaccel.proxy.apis.responses import ResponsesApi
from agentaccel.proxy.tagging import resolve, system_fingerprint
from agentaccel.text.compaction import INSTRUCTIONS, SUMMARIZERS, compaction_of
from agentaccel.text.messages import normalized, reply_content, turn_of
from agentaccel.text.render import render_prompt
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.xdist_group("test_openhands")  # its OpenHands environment, built once, is shared
WINDOW = 8192  # the embedded model's context
CHAPTERS = 4
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()
TASK = (f"Print the chapters 0 to {CHAPTERS - 1} of the book, one at a time, with `python3 chapter.py N`, then tell "
        f"me the last word of chapter {CHAPTERS - 1}.")


def chapter(k: int, lines: int = 105) -> str:
    """About 1,650 of the embedded model's tokens (105 lines): four of them and any client's prompt are past
    the window."""
    pick = random.Random(k).choice
    return "\n".join(" ".join(pick(WORDS) for _ in range(12)) for _ in range(lines)) + "\n"


FINAL = f"The last word of chapter {CHAPTERS - 1} is {chapter(CHAPTERS - 1).split()[-1]}."


def summary(read: int) -> str:
    """The model's summary once chapters 0..read-1 are printed, as Claude Code asks for it (an
    analysis, then the summary: its own line each time, by which replay finds the turns after it)."""
    return (f"<analysis>\nChapters 0 to {read - 1} are printed.\n</analysis>\n<summary>\n"
            f"SUMMARY {read}: the user asked for chapters 0 to {CHAPTERS - 1} printed one at a time with "
            f"`python3 chapter.py N`, then the last word of chapter {CHAPTERS - 1}; chapters 0 to {read - 1} are "
            f"printed, chapter {read} is next.\n</summary>")


def book(root: Path, chapters: int = CHAPTERS, lines: int = 105) -> Path:
    (root / "chapters").mkdir(parents=True)
    for k in range(chapters):
        (root / "chapters" / f"{k}.txt").write_text(chapter(k, lines))
    (root / "chapter.py").write_text("import sys\n\nprint(open(f'chapters/{sys.argv[1]}.txt').read(), end='')\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def tool_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def row(prompt: list[dict], reply: dict) -> str:
    return json.dumps({"messages": [*prompt, reply], "stage": "authored", "model": MODEL,
                       "metadata": {"session": "long-session"}}) + "\n"


def authored_session(first: list[dict], printing, compaction: str) -> str:
    """Chat JSONL of the model's side of the session: from the client's first prompt (`first`),
    and after each summary, every turn's step (`printing(id, k)`: the tool call printing chapter k;
    then the final answer) and, from the second turn on, the summary of what is printed so far,
    answering the client's request for one there instead (it ends with `compaction`, the
    client's instruction: text/compaction.py)."""
    rows = []
    for covered in range(CHAPTERS + 1):  # 0: the session's start; n: after the summary of n chapters
        prompt = list(first) if covered == 0 else [{"role": "user", "content": f"(continued)\n{summary(covered)}"}]
        for read in range(covered, CHAPTERS + 1):  # `read` chapters printed before this turn
            step = ({"role": "assistant", "content": "", "tool_calls": [printing(f"{covered}_{read}", read)]}
                    if read < CHAPTERS else {"role": "assistant", "content": FINAL})
            rows.append(row(prompt, step))
            if read > covered:  # a turn after a step: the client may ask for a summary here instead
                rows.append(row([*prompt, {"role": "user", "content": compaction}],
                                {"role": "assistant", "content": summary(read)}))
            if read < CHAPTERS:
                prompt += [step, {"role": "tool", "tool_call_id": step["tool_calls"][0]["id"],
                                  "content": "(the chapter)"}]
    return "".join(rows)


def claude_read(call_id: str, k: int) -> dict:
    return tool_call(f"toolu_{call_id}", "Bash", {"command": f"python3 chapter.py {k}",
                                                  "description": f"Print chapter {k}"})


def codex_read(call_id: str, k: int) -> dict:
    return tool_call(f"call_{call_id}", "exec_command", {"cmd": f"python3 chapter.py {k}"})


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """Both CLIs, installed from npm once (cached under ~/.cache/agentaccel/clients)."""
    return {c.name: installed(c) for c in (CLAUDE_CODE, CODEX)}


def claude(cli: Path, url: str, home: Path, repo: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    # as `claude-code-config` sets it for the window the proxy lists
    settings = claude_code_env(url, MODEL, max_output=512, context_window=WINDOW)
    done = subprocess.run([str(cli), "-p", TASK, "--model", MODEL, "--output-format", "stream-json", "--verbose",
                           "--tools", "Bash", "--allowedTools", "Bash"], cwd=repo, env=environment(home, settings),
                          capture_output=True, text=True, timeout=180)
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def codex(cli: Path, url: str, home: Path, repo: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    # the window, and the size at which Codex compacts before it calls the model, as `codex-config` sets them
    (home / ".codex" / "config.toml").write_text(codex_config(url, MODEL, context_window=WINDOW))
    done = subprocess.run([str(cli), "exec", "--json", "--skip-git-repo-check",
                           "--dangerously-bypass-approvals-and-sandbox", TASK], cwd=repo,
                          env=environment(home, {}), capture_output=True, text=True, timeout=180)
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


CLIENTS = {"claude-code": (claude, claude_read, MessagesApi()), "codex": (codex, codex_read, ResponsesApi())}


def statuses(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("agentaccel_requests_total{"):
            status = line.split('status="')[1].split('"')[0]
            out[status] = out.get(status, 0.0) + float(line.split()[-1])
    return out


@pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)
@pytest.mark.parametrize("client", ["claude-code", "codex"])
def test_a_session_past_the_window_is_compacted_and_finished(clis, tmp_path, client):
    run, printing, api = CLIENTS[client]
    repo = book(tmp_path / "repo")
    with FirstRequest() as capture:  # what the client wraps around the task, from this repository
        run(clis[client], capture.url, tmp_path / "capture-home", repo)
    [body] = capture.bodies.values()
    chat = api.to_chat(body)
    first, tokenizer = chat["messages"], load_tokenizer()
    # the client's first prompt and the chapters: past the window
    prompt = len(tokenizer.encode(render_prompt(first, tokenizer.chat_template, chat.get("tools"))))
    assert prompt + sum(len(tokenizer.encode(chapter(k))) for k in range(CHAPTERS)) > WINDOW
    (tmp_path / "authored.jsonl").write_text(authored_session(first, printing, INSTRUCTIONS[client][0]))
    with TraceStore(tmp_path / "recordings.db") as store:
        import_traces([tmp_path / "authored.jsonl"], store, tokenizer=tokenizer)

    db = tmp_path / "history.db"
    with serving(["--backend", "replay", "--recordings", str(tmp_path / "recordings.db"), "--db", str(db),
                  "--step-ms", "1", "--context-window", str(WINDOW)], tmp_path / "serve.log") as url:
        done, events = run(clis[client], url, tmp_path / "home", repo)
        answered = statuses(url)
        lookups = {line.split('result="')[1].split('"')[0]: float(line.split()[-1])
                   for line in httpx.get(url + "/metrics").text.splitlines()
                   if line.startswith("agentaccel_replay_lookups_total{")}
    assert done.returncode == 0, (answered, done.stdout[-3000:], done.stderr[-2000:])
    if client == "claude-code":
        final = events[-1]["result"]
        printed = [json.dumps(b) for e in events if e.get("type") == "user" for b in e["message"]["content"]
                   if isinstance(b, dict) and b.get("type") == "tool_result"]
        assert any(e.get("subtype") == "compact_boundary" for e in events), done.stdout[-3000:]
    else:
        final = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                 and e["item"].get("type") == "agent_message"][-1]
        printed = [e["item"]["aggregated_output"] for e in events if e.get("type") == "item.completed"
                   and e["item"].get("type") == "command_execution"]
    assert final == FINAL
    # every chapter printed by the real tool, in order
    assert [k for p in printed for k in range(CHAPTERS) if chapter(k).split("\n")[0] in p] == list(range(CHAPTERS))
    # no 5xx; a 400 only past the window (every request the client sent had its recorded answer)
    assert set(answered) <= {"200", "400"} and lookups["none"] == lookups["ambiguous"] == 0, (answered, lookups)

    with TraceStore(db) as store:
        calls = list(store.iter_calls())
    compactions = [c for c in calls if compaction_of(c.messages) == client]
    assert compactions, [c.messages[-1] for c in calls]
    # the client's stage, and its compactions in a stage of their own
    assert {c.stage for c in calls if c not in compactions} == {client}
    assert {c.stage for c in compactions} == {client + ":compact"}
    assert all("SUMMARY " in c.response for c in compactions)
    # the calls after the first compaction carry its summary, not the chapters it replaced
    after = calls[calls.index(compactions[0]) + 1]
    said = compactions[0].response.split("\n")[-2]  # the summary's line
    assert said in json.dumps(after.messages) and chapter(0).split("\n")[0] not in json.dumps(after.messages)
    if client == "codex":
        its_rollout_imports_as_served(tmp_path, tmp_path / "home" / ".codex" / "sessions", db, calls, compactions)


def answer_key(call) -> tuple:
    """A call by what the model answered and when: its turn, its text, its tool calls' ids and names
    (records.client_call_key without the session: both stores hold one session)."""
    return (turn_of(call.messages), reply_content(call.response, call.tool_calls).strip(),
            tuple((c.get("id"), (c.get("function") or {}).get("name")) for c in call.tool_calls or ()))


def sent_as(logged: str, sent: str) -> bool:
    """Whether Codex sent the instructions its rollout logs (`session_meta.base_instructions`, the
    imported system prompt) as `sent`: whole, or without the sections about a tool this session
    does not have (its plan tool, `update_plan`: Codex cuts them from what it sends, and the rollout
    does not log which tools the session had). Nothing else may differ."""
    logged_lines, sent_lines = logged.splitlines(), sent.splitlines()
    ops = difflib.SequenceMatcher(None, logged_lines, sent_lines, autojunk=False).get_opcodes()
    cut = [logged_lines[i1:i2] for tag, i1, i2, _, _ in ops if tag != "equal"]
    return all(tag in ("equal", "delete") for tag, *_ in ops) and all(
        any(line.startswith("## ") and "plan" in line.lower() for line in lines) for lines in cut)


def its_rollout_imports_as_served(tmp_path: Path, sessions: Path, db: Path, served: list, compactions: list) -> None:
    """Codex's own rollout of the session (which compacted): imported into a store of its own, each
    of its calls has the prompt the proxy recorded live for the call with the same answer at the
    same turn, and the same stage. Prompts are the messages as stored, compared whole: roles,
    texts, tool calls and the calls they answer (`normalized` leaves aside only the form of a
    content, a list of parts or a string), the system prompt as `sent_as` says. A summarizing call
    differs by one message: the rollout holds its answer (the summary), filed as the proxy files it
    (`codex:compact`), but not the instruction Codex appended to ask for it. Imported
    into the store that recorded it live, the rollout adds nothing (traces/client_keys.py)."""
    [rollout] = sorted(sessions.rglob("*.jsonl"))
    assert any(json.loads(line).get("type") == "compacted" for line in rollout.read_text().splitlines())
    with TraceStore(tmp_path / "imported.db") as store:
        assert import_traces([rollout], store).calls > 0
        imported = list(store.iter_calls())
    live = {answer_key(c): c for c in served}
    assert len(live) == len(served)  # no two served calls answer alike at one turn
    assert sorted(map(answer_key, imported)) == sorted(live), "the rollout's calls are not the served ones"
    after = [c for c in imported if answer_key(c) == answer_key(served[served.index(compactions[0]) + 1])]
    assert after and "SUMMARY " in json.dumps(after[0].messages)  # a call after a compaction, from its history
    for call in imported:
        sent = live[answer_key(call)]
        expected = sent.messages
        if sent in compactions:
            assert sent.messages[-1]["content"].startswith(INSTRUCTIONS["codex"])
            expected = sent.messages[:-1]
        assert [normalized(m) for m in call.messages[1:]] == [normalized(m) for m in expected[1:]], \
            (answer_key(call)[:2], call.messages[-3:], sent.messages[-3:])
        assert call.messages[0]["role"] == expected[0]["role"] == "system"
        assert sent_as(normalized(call.messages[0])["content"], normalized(expected[0])["content"])
        assert call.stage == sent.stage, answer_key(call)[:2]
    with TraceStore(db) as store:
        assert import_traces([rollout], store).calls == 0
        assert len(list(store.iter_calls())) == len(served)


# ---------------------------------------------------------------------------- the parts, fast
def recorded(tmp_path: Path, printing=claude_read, compaction: str = INSTRUCTIONS["claude-code"][0]) -> Path:
    task = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": TASK}]
    (tmp_path / "authored.jsonl").write_text(authored_session(task, printing, compaction))
    with TraceStore(tmp_path / "recordings.db") as store:
        import_traces([tmp_path / "authored.jsonl"], store, tokenizer=load_tokenizer())
    return tmp_path / "recordings.db"


def test_a_compaction_is_told_from_the_step_it_replaces_and_the_turns_after_its_summary_are_found(tmp_path):
    """The replay lookup of a compacting client's calls: at a turn, the step or (the client's
    instruction after the tool's output, among reminders) the summary; after it, the turns that
    go on from the summary, however the client wraps it (tags dropped, a lead-in, other text)."""
    with TraceStore(recorded(tmp_path)) as store:
        recordings = Recordings(store)
    step = claude_read("x", 0)
    head = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": TASK}]
    turn1 = [*head, {"role": "assistant", "content": "", "tool_calls": [step]},
             {"role": "tool", "tool_call_id": step["id"], "content": chapter(0)}]
    assert json.loads(recordings.match(turn1).tool_calls[0]["function"]["arguments"])["command"] == \
        "python3 chapter.py 1"
    instruction = INSTRUCTIONS["claude-code"][0] + "\nMore."
    asked = [*turn1, {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                                  {"type": "text", "text": instruction}]},
             {"role": "system", "content": "# Environment"}]
    assert compaction_of(asked) == "claude-code" and compaction_of(turn1) is None
    said = recordings.match(asked).content
    assert said == summary(1)
    # Claude Code's form: the analysis dropped, the summary after a lead-in, a path after it
    kept = said.split("<summary>\n")[1].split("\n</summary>")[0]
    after = [{"role": "system", "content": "You are an agent."},
             {"role": "user", "content": f"This session is being continued.\nSummary:\n{kept}\n\nRead /tmp/x.jsonl"},
             {"role": "assistant", "content": "", "tool_calls": [claude_read("y", 1)]},
             {"role": "tool", "tool_call_id": "toolu_y", "content": chapter(1)},
             {"role": "user", "content": "<system-reminder>attribution</system-reminder>"}]
    assert json.loads(recordings.match(after).tool_calls[0]["function"]["arguments"])["command"] == \
        "python3 chapter.py 2"
    assert recordings.match(after[:2]).tool_calls[0]["function"]["arguments"] == claude_read("", 1)["function"][
        "arguments"]
    # a turn past what was recorded after the summary is refused, saying where the recording stops
    late = [*after[:2], *[m for k in range(4) for m in (
        {"role": "assistant", "content": "", "tool_calls": [claude_read(f"z{k}", k)]},
        {"role": "tool", "tool_call_id": f"toolu_z{k}", "content": "..."})]]
    with pytest.raises(NoRecording, match=r"continues a compacted conversation .*SUMMARY 1.*turns 0\.\.3 after it; "
                                          r"this request is turn 4"):
        recordings.match(late)


def test_each_clients_compaction_request_is_recognised():
    conversation = [{"role": "user", "content": TASK}, {"role": "assistant", "content": "ok"}]
    codex = [*conversation, {"role": "user", "content": INSTRUCTIONS["codex"][0] + " Create a handoff summary."}]
    openhands = [{"role": "system", "content": "You are maintaining a context-aware state summary for an interactive "
                                               "agent.\nTrack: ..."}, {"role": "user", "content": "<EVENT>...</EVENT>"}]
    quoted = [*conversation, {"role": "tool", "content": INSTRUCTIONS["codex"][0]}]  # a tool's output that quotes it
    earlier = [{"role": "user", "content": INSTRUCTIONS["codex"][0]}, {"role": "assistant", "content": "summary"},
               {"role": "user", "content": "go on"}]  # asked before the conversation's last turn
    assert [compaction_of(m) for m in (codex, openhands, quoted, earlier, conversation, [])] == \
        ["codex", "openhands", None, None, None, None]


def test_a_clients_compaction_request_is_served_in_the_stage_of_its_compactions(tmp_path):
    """Claude Code's and Codex's compaction requests carry their main loop's stage tag (the header
    their config sets) and system prompt: they are served, and recorded, as that stage with
    `:compact` after it, whichever rule named the stage; a summarizer's own call (the OpenHands
    condenser's) keeps the stage its tag names, and a tool's output that quotes an instruction is
    no request for a summary."""
    with TraceStore(recorded(tmp_path)) as store:
        backend = ReplayBackend(store, load_tokenizer(), parse("gpu"), step_ms=0.0)
    step = claude_read("x", 0)
    turn1 = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": TASK},
             {"role": "assistant", "content": "", "tool_calls": [step]},
             {"role": "tool", "tool_call_id": step["id"], "content": chapter(0)}]
    asked = [*turn1, {"role": "user", "content": INSTRUCTIONS["claude-code"][0] + "\nMore."}]
    with ServerThread(create_app(ProxyConfig(record=False), backend)) as server:
        for messages, stage in ((turn1, "claude-code"), (asked, "claude-code:compact")):
            reply = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages},
                               headers={"X-Agentaccel-Stage": "claude-code"}, timeout=30)
            assert reply.status_code == 200 and reply.headers["x-agentaccel-stage"] == stage, reply.text
    codex = [*turn1, {"role": "user", "content": INSTRUCTIONS["codex"][0] + " Create a handoff summary."}]
    condenser = [{"role": "system", "content": SUMMARIZERS["openhands"][0]}, {"role": "user", "content": "<EVENT>"}]
    quoted = [*turn1[:3], {"role": "tool", "tool_call_id": step["id"], "content": INSTRUCTIONS["codex"][0]}]
    stage = {"x-agentaccel-stage": "codex"}  # as the server hands them (its headers read in any case)
    assert resolve(stage, {"messages": codex}, []).stage == "codex:compact"
    assert resolve({"x-agentaccel-stage": "codex:compact"}, {"messages": codex}, []).stage == "codex:compact"
    assert resolve({}, {"messages": codex}, []).stage == f"{system_fingerprint('You are an agent.')}:compact"
    assert resolve({}, {"messages": condenser, "tags": ["agent:condenser"]}, []).stage == "openhands:condenser"
    assert resolve(stage, {"messages": quoted}, []).stage == "codex"


def test_a_codex_rollout_files_the_summary_it_asked_for_in_the_stage_of_its_compactions(tmp_path):
    """Codex logs the answer of its compaction call (marked `compaction_output`), not the
    instruction it asked with: imported, that call is in `codex:compact` with the history it
    summarized as its prompt; an answer not so marked stays in `codex`, a `compacted` line after
    it or not (Codex may compact between a turn's last answer and the user's next message)."""
    def line(kind, payload, **extra):
        return json.dumps({"timestamp": "2026-11-28T10:00:00.000Z", "type": kind, "payload": payload, **extra}) + "\n"

    def said(role, text):
        return {"type": "message", "role": role,
                "content": [{"type": "output_text" if role == "assistant" else "input_text", "text": text}]}

    step = {"type": "function_call", "name": "exec_command", "arguments": "{}", "call_id": "call_1"}
    kept = [said("developer", "<permissions instructions>x</permissions instructions>"), said("user", TASK)]
    rows = [line("session_meta", {"id": "s1", "base_instructions": {"text": "You are Codex."}}),
            *(line("response_item", item) for item in kept), line("response_item", step),
            line("response_item", {"type": "function_call_output", "call_id": "call_1", "output": "(the chapter)"}),
            line("response_item", said("assistant", summary(1)), metadata={"compaction_output": True}),
            line("compacted", {"message": summary(1), "replacement_history": [*kept, said("user", summary(1))]}),
            line("response_item", said("assistant", FINAL)),
            line("compacted", {"message": "later", "replacement_history": kept}),
            line("response_item", said("user", "thanks")), line("response_item", said("assistant", "ok"))]
    (tmp_path / "rollout.jsonl").write_text("".join(rows))
    with TraceStore(tmp_path / "imported.db") as store:
        import_traces([tmp_path / "rollout.jsonl"], store)
        calls = list(store.iter_calls())
    assert [(c.stage, reply_content(c.response, c.tool_calls)) for c in calls] == [
        ("codex", ""), ("codex:compact", summary(1)), ("codex", FINAL), ("codex", "ok")]
    assert [m["role"] for m in calls[1].messages] == ["system", "system", "user", "assistant", "tool"]


def test_the_replay_window_refuses_what_the_model_could_not_read_and_is_listed(tmp_path):
    """`--context-window`: a prompt past it gets the API's 400 (context_length_exceeded), before
    any recording is looked up; within it, the recorded answer; /v1/models lists it. Without one,
    any prompt is answered (recordings of larger models replay whole)."""
    import openai

    db = recorded(tmp_path)
    head = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": TASK}]
    long = [*head, {"role": "assistant", "content": "", "tool_calls": [claude_read("x", 0)]},
            {"role": "tool", "tool_call_id": "toolu_x", "content": chapter(0) * 4}]
    answers = {}
    for window in (1024, None):
        with TraceStore(db) as store:
            backend = ReplayBackend(store, load_tokenizer(), parse("gpu"), step_ms=0.0, context=window)
        with ServerThread(create_app(ProxyConfig(record=False), backend)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
            assert client.chat.completions.create(model="replay", messages=head).choices[0].message.tool_calls
            try:
                answers[window] = client.chat.completions.create(model="replay", messages=long).choices[0]
            except openai.BadRequestError as e:
                answers[window] = e
            listed = httpx.get(server.url + "/v1/models").json()["data"][0]
            assert listed.get("max_model_len") == window
            lookups = {line.split('result="')[1].split('"')[0]: float(line.split()[-1])
                       for line in httpx.get(server.url + "/metrics").text.splitlines()
                       if line.startswith("agentaccel_replay_lookups_total{")}
            assert lookups["fallback"] + lookups["exact"] == (1 if window else 2)  # refused before its lookup
    refused = answers[1024]
    assert isinstance(refused, openai.BadRequestError) and refused.code == "context_length_exceeded"
    assert "1024" in refused.message
    assert answers[None].message.tool_calls[0].function.arguments == claude_read("", 1)["function"]["arguments"]


def test_bench_agent_ttft_times_each_turn_of_a_recorded_session_until_the_window(tmp_path):
    """`bench agent --recorded --ttft --url`: the session's calls sent again in order, one token
    each; the table, the JSON and the plot; a call past the server's window ends the timing there."""
    db = recorded(tmp_path)
    with TraceStore(db) as store:
        calls = len(list(store.iter_calls()))
        backend = ReplayBackend(store, load_tokenizer(), parse("gpu"), step_ms=0.0, context=150)
    with ServerThread(create_app(ProxyConfig(record=False), backend)) as server:
        out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "agent", "--recorded", "--db",
                              str(db), "--ttft", "--url", server.url, "--json", str(tmp_path / "ttft.json"), "--plot",
                              str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [turns] = json.loads((tmp_path / "ttft.json").read_text())["ttft"].values()
    assert [t["turn"] for t in turns] == list(range(len(turns))) and 1 < len(turns) < calls
    *timed, refused = turns
    assert all(t["ttft_seconds"] > 0 and t["prompt_tokens"] > 0 and t["error"] is None for t in timed)
    assert refused["ttft_seconds"] is None and refused["error"].startswith("400") and "150" in refused["error"]
    assert "time to first token per turn" in out.stdout and (tmp_path / "agent_ttft_per_turn.png").stat().st_size


# ---------------------------------------------------------------------------- OpenHands: its condenser
OH_CHAPTERS, OH_LINES = 14, 22  # about 350 tokens each: with the agent's 3,600-token prompt, past the window
OH_TASK = (f"Print the chapters 0 to {OH_CHAPTERS - 1} of the book, one at a time, with `python3 chapter.py N`, then "
           f"finish with the last word of chapter {OH_CHAPTERS - 1}.")
OH_MAX_SIZE = 8  # the condenser's most events: it summarizes after the 4th chapter, then every 3rd
OH_SUMMARIZED = (0, *range(4, OH_CHAPTERS, 3), OH_CHAPTERS)  # the chapters its summaries cover, in turn


def oh_summary(read: int) -> str:
    return (f"SUMMARY {read}: chapters 0 to {read - 1} of the {OH_CHAPTERS} are printed with `python3 chapter.py "
            f"N`; chapter {read} is next, then the last word of chapter {OH_CHAPTERS - 1}.")


def oh_final() -> str:
    return f"The last word of chapter {OH_CHAPTERS - 1} is {chapter(OH_CHAPTERS - 1, OH_LINES).split()[-1]}."


def openhands_session(first: list[dict]) -> str:
    """The OpenHands agent's side (the terminal tool printing each chapter, then `finish`), from
    its first prompt and after each summary (a user message after the task), and the condenser's:
    a call of its own (its instruction as the system prompt, the forgotten events as the user
    message, the latest summary among them) answered with the next summary."""
    rows, summarizer = [], SUMMARIZERS["openhands"][0]
    for covered in OH_SUMMARIZED:
        prompt = list(first) + ([{"role": "user", "content": oh_summary(covered)}] if covered else [])
        for read in range(covered, OH_CHAPTERS + 1):
            call = (tool_call(f"call_{covered}_{read}", "terminal", {"command": f"python3 chapter.py {read}"})
                    if read < OH_CHAPTERS else tool_call(f"call_{covered}_end", "finish", {"message": oh_final()}))
            step = {"role": "assistant", "content": "", "tool_calls": [call]}
            rows.append(row(prompt, step))
            prompt += [step, {"role": "tool", "tool_call_id": call["id"], "content": "(the chapter)"}]
    for before, after in zip(OH_SUMMARIZED, OH_SUMMARIZED[1:], strict=False):
        events = "<EVENT>\n(the events it forgets)\n</EVENT>" + (f"\n<EVENT>\n{oh_summary(before)}\n</EVENT>"
                                                                  if before else "")
        rows.append(row([{"role": "system", "content": summarizer + "\n(its rules)"},
                         {"role": "user", "content": events}],
                        {"role": "assistant", "content": oh_summary(after)}))
    return "".join(rows)


@pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)
def test_an_openhands_agent_past_the_window_is_condensed_and_finished(tmp_path, openhands_python):
    from agentaccel.processes import run_group

    repo = book(tmp_path / "repo", OH_CHAPTERS, OH_LINES)
    runner = shutil.copy(Path(__file__).with_name("openhands_condensing_runner.py"), tmp_path / "runner.py")
    # the SDK refuses a window under 16,384 tokens unless told it is meant (an 8 k model's user must say so)
    env = {**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "TMUX_TMPDIR": tempfile.mkdtemp(prefix="t"),
           "ALLOW_SHORT_CONTEXT_WINDOWS": "true"}

    def run(url: str):
        done = run_group([str(openhands_python), str(runner), "--base-url", url, "--workspace", str(repo), "--task",
                          OH_TASK, "--window", str(WINDOW), "--max-size", str(OH_MAX_SIZE)], env=env, timeout=300,
                         cwd=tmp_path)
        return done, json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}

    with FirstRequest() as capture:
        run(capture.url)
    [body] = capture.bodies.values()
    first, tokenizer = body["messages"], load_tokenizer()
    prompt = len(tokenizer.encode(render_prompt(first, tokenizer.chat_template, body.get("tools"))))
    assert prompt + sum(len(tokenizer.encode(chapter(k, OH_LINES))) for k in range(OH_CHAPTERS)) > WINDOW
    (tmp_path / "authored.jsonl").write_text(openhands_session(first))
    with TraceStore(tmp_path / "recordings.db") as store:
        import_traces([tmp_path / "authored.jsonl"], store, tokenizer=tokenizer)
    db = tmp_path / "history.db"
    with serving(["--backend", "replay", "--recordings", str(tmp_path / "recordings.db"), "--db", str(db),
                  "--step-ms", "1", "--context-window", str(WINDOW)], tmp_path / "serve.log") as url:
        done, outcome = run(url)
        answered = statuses(url)
    assert outcome.get("status") == "finished" and outcome["finished_with"] == oh_final(), \
        (answered, outcome, done.stderr[-3000:])
    assert outcome["condensations"] >= 3 and set(answered) <= {"200", "400"}, (answered, outcome)
    with TraceStore(db) as store:
        calls = list(store.iter_calls())
    condensed = [c for c in calls if c.stage == "openhands:condenser"]
    assert len(condensed) == outcome["condensations"] and all(compaction_of(c.messages) == "openhands"
                                                              for c in condensed)
    assert {c.stage for c in calls} == {"openhands:CodeActAgent", "openhands:condenser"}
