"""Imported history reaches the stage live calls are served under (issue 46). OpenHands' classic core,
its SDK and its 1.x app send no stage tag; their recorded runs import as the framework's own stage
(`openhands:CodeActAgent`, `openhands:Agent`). `import-traces` runs the imported calls through the
template miner `serve` runs, so a live untagged call of the same prompt template is served as the
imported stage and drafts from the imported answers. Per framework, on the embedded backend (the real
SmolLM2): yesterday's run is written in the framework's own format with the answer the model gives;
today the same first call arrives untagged and nearly all of its tokens are accepted from the
imported answer."""

import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")

from servers import ServerThread, metric  # noqa: E402
from traces_fixtures import write_output_jsonl, write_sdk_conversation  # noqa: E402

from agentaccel.backends.local.service import LocalBackend  # noqa: E402
from agentaccel.backends.seeding import seed_from_store  # noqa: E402
from agentaccel.engine import SuffixEngine  # noqa: E402
from agentaccel.proxy import ProxyConfig, create_app  # noqa: E402
from agentaccel.text.tokenization import load_tokenizer  # noqa: E402
from agentaccel.traces.database import locate  # noqa: E402
from agentaccel.traces.importer import import_traces  # noqa: E402
from agentaccel.traces.store import TraceStore  # noqa: E402

MODEL, MAX_TOKENS = "SmolLM2-135M-Instruct", 40
CLASSIC_ANSWER, SDK_ANSWER = "Let me look.", "Creating it."  # the first answer in each fixture


def classic(root: Path) -> Path:
    root.mkdir()
    write_output_jsonl(root / "output.jsonl", instances=3)  # an evaluation's output.jsonl, three issues
    return root / "output.jsonl"


def sdk(root: Path) -> Path:
    for n in range(3):
        write_sdk_conversation(root / "conversations", f"{n:032x}")
    return root / "conversations"


def app(root: Path) -> Path:
    """The 1.x app keeps the same conversation folders inside its sandboxes' workspaces; its system
    prompt ends with the conversation's date and time."""
    for n in range(3):
        write_sdk_conversation(root / "openhands-sandboxes" / f"sandbox{n}" / "workspace" / "conversations",
                               f"{n:032x}", dynamic_context=f"<CURRENT_DATETIME>\n2026-11-2{n}\n</CURRENT_DATETIME>")
    (root / "openhands-sandboxes" / "settings.json").write_text("{}")  # files beside them are left alone
    return root / "openhands-sandboxes"


FRAMEWORKS = {"classic": (classic, CLASSIC_ANSWER, "openhands:CodeActAgent"),
              "sdk": (sdk, SDK_ANSWER, "openhands:Agent"),
              "app": (app, SDK_ANSWER, "openhands:Agent")}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def imported(source: Path, db: Path, tokenizer):
    with TraceStore(db) as store:
        report = import_traces([source], store, tokenizer=tokenizer)
        first = next(store.iter_calls())
    return report, first


def answer_in_files(source: Path, old: str, new: str) -> None:
    """Yesterday's run, as the framework wrote it, with the model's own first answer in it."""
    files = [source] if source.is_file() else [p for p in source.rglob("*.json*") if p.is_file()]
    for path in files:
        text = path.read_text()
        path.write_text(text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1]))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_imported_run_seeds_the_stage_its_live_untagged_calls_are_served_as(framework, tokenizer, tmp_path):
    write, placeholder, stage = FRAMEWORKS[framework]
    # the first call of the run, as the importer rebuilds it: what the framework sends
    _, first = imported(write(tmp_path / "probe"), tmp_path / "probe.db", tokenizer)
    plain = ServerThread(create_app(ProxyConfig(discover_stages=False, record=False), LocalBackend(SuffixEngine())))
    with plain:
        answer = send(plain.url, first.messages)[1]
    source = write(tmp_path / "yesterday")
    answer_in_files(source, placeholder, answer)
    db = tmp_path / "traces.db"
    report, first = imported(source, db, tokenizer)
    assert report.mapped and set(report.mapped.values()) == {stage}, report.mapped
    assert first.stage == stage and answer in first.response
    engine = SuffixEngine()
    with TraceStore(db) as store:
        assert seed_from_store(engine, store, tokenizer).calls == report.calls
    # today: the same first call, untagged, through `serve` with discovery on, seeded from the store
    server = ServerThread(create_app(ProxyConfig(db_path=locate(db), record=False), LocalBackend(engine)))
    with server:
        served_as, text, tokens = send(server.url, first.messages)
        assert text == answer and served_as == stage
        accepted = metric(server.url, "agentaccel_accepted_tokens_total", stage)
        # the imported answer drafted: all but the steps' own tokens (a cold call accepts a handful)
        assert accepted >= tokens * 0.6, (accepted, tokens)


def send(url: str, messages: list[dict]) -> tuple[str, str, int]:
    """(the stage the proxy served it as, the reply, its tokens), greedy and untagged."""
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return r.headers["x-agentaccel-stage"], body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def test_import_traces_and_traces_stages_say_what_live_calls_will_be_served_as(tmp_path):
    import subprocess
    import sys

    def agentaccel(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    db = str(tmp_path / "t.db")
    said = agentaccel("import-traces", str(classic(tmp_path / "runs")), "--db", db)
    assert "untagged calls of 1 prompt template will be served as openhands:CodeActAgent" in said, said
    table = agentaccel("traces", "stages", "--db", db)
    assert "served as" in table and "openhands:CodeActAgent" in table and "tmpl:" in table
    again = agentaccel("import-traces", str(tmp_path / "runs"), "--db", db)  # known already: nothing new to say
    assert "will be served as" not in again
