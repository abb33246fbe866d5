"""OpenHands' 1.x app (openhands-ai 1.11) as its users drive it, for the tests, run by OpenHands'
own Python: `python openhands_app.py --settings JSON --task TEXT` starts the app server
(`openhands_app.py serve PORT`), stores the LLM settings through its API (what `agentaccel
openhands-config` prints), starts one conversation with the task, waits until the agent has
finished, and prints one JSON line: the conversation's id, its status and its sandbox's folder.
`python openhands_app.py title-prompt TASK` prints the messages the agent server sends the model
to title a conversation that starts with TASK (the SDK's own title_utils builds them), so that a
recording can answer that call too.

Two things in 1.11 stop its process runtime on a machine like this one; they are worked around
here, in this process, leaving OpenHands' installed files as they are (docs/SERVING.md says what
a user of 1.11 meets):

- its process sandbox counts the agent server as started only while psutil reports the process
  "running"; an agent server waiting for requests "sleeps", so every start times out after 120 s.
  Here a sleeping agent server counts as running (what the app then checks is its /alive).
- it turns the browser tool on for every conversation, and the agent server then refuses to start
  the conversation without Chromium. Here the agent gets the default tools without the browser.

The third, the app rewriting `localhost` to `host.docker.internal` when it finds /.dockerenv, is
met as a user in a container meets it: the test's sandbox names that host 127.0.0.1."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import uvicorn
from openhands.app_server.app_conversation import live_status_app_conversation_service as live
from openhands.app_server.sandbox import process_sandbox_service as process_sandbox
from openhands.app_server.sandbox.sandbox_models import SandboxStatus

_status = process_sandbox.ProcessSandboxService._get_process_status


def _status_counting_idle_as_running(self, process_info):
    status = _status(self, process_info)
    if status == SandboxStatus.STARTING:
        try:
            if psutil.Process(process_info.pid).status() in (psutil.STATUS_SLEEPING, psutil.STATUS_IDLE):
                return SandboxStatus.RUNNING
        except psutil.Error:
            return SandboxStatus.MISSING
    return status


_tools = live.get_default_tools


def _tools_without_browser(enable_browser: bool = True, **options):
    return _tools(enable_browser=False, **options)


process_sandbox.ProcessSandboxService._get_process_status = _status_counting_idle_as_running
live.get_default_tools = _tools_without_browser



def wait_for(what: str, check, timeout: float):
    """check()'s first truthy value within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def drive(app: str, settings: dict, task: str, timeout: float) -> dict:
    r = httpx.post(f"{app}/api/v1/settings", json=settings, timeout=30)
    r.raise_for_status()
    r = httpx.post(f"{app}/api/v1/app-conversations", timeout=60,
                   json={"initial_message": {"content": [{"type": "text", "text": task}], "run": True}})
    r.raise_for_status()
    start = r.json()

    def started():
        [t] = httpx.get(f"{app}/api/v1/app-conversations/start-tasks", params={"ids": [start["id"]]}).json()
        if t and t["status"] == "ERROR":
            raise RuntimeError(f"the conversation did not start: {t.get('detail')}")
        return t if t and t["status"] == "READY" else None

    task_info = wait_for("the conversation's start", started, timeout)
    conversation = task_info["app_conversation_id"]

    def finished():
        [c] = httpx.get(f"{app}/api/v1/app-conversations", params={"ids": [conversation]}).json()
        if c and c.get("execution_status") in ("finished", "error", "stuck"):
            return c
        return None

    info = wait_for("the agent's finish", finished, timeout)
    folder = Path(tempfile.gettempdir()) / "openhands-sandboxes" / task_info["sandbox_id"]
    return {"conversation": conversation, "status": info["execution_status"], "sandbox": str(folder)}


class _TitlePrompt(BaseException):  # noqa: N818 - not an error: it carries the prompt out past the SDK's `except Exception`
    pass


class _Capture:
    """Stands in for the LLM only to read the prompt the SDK builds; never answers."""
    stream = False

    def completion(self, messages):
        raise _TitlePrompt([{"role": m.role, "content": "".join(c.text for c in m.content)} for m in messages])


def title_prompt(task: str) -> list[dict]:
    from openhands.sdk.conversation import title_utils

    try:
        title_utils.generate_title_with_llm(task, _Capture())
    except _TitlePrompt as prompt:
        return prompt.args[0]
    raise RuntimeError("the SDK built no title prompt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", required=True, help="the POST /api/v1/settings body, JSON")
    parser.add_argument("--task", required=True)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--log", type=Path, required=True, help="where the app server's output goes")
    parser.add_argument("--port", type=int, required=True, help="the app server's (the test's free_port)")
    args = parser.parse_args()
    port = args.port
    app = f"http://127.0.0.1:{port}"
    log = args.log.open("w")  # noqa: SIM115 - open for the server's lifetime
    server = subprocess.Popen([sys.executable, __file__, "serve", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "RUNTIME": "process"})
    try:
        wait_for("the app server", lambda: httpx.get(f"{app}/alive").status_code == 200, 120)
        print(json.dumps(drive(app, json.loads(args.settings), args.task, args.timeout)), flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        uvicorn.run("openhands.app_server.app:app", host="127.0.0.1", port=int(sys.argv[2]), log_level="info")
    elif sys.argv[1:2] == ["title-prompt"]:
        print(json.dumps(title_prompt(sys.argv[2])))
    else:
        main()
