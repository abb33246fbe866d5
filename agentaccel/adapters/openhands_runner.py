"""Runs one OpenHands SDK agent (terminal and file-editor tools) on one task through a proxy, as a
user's script would. It runs under OpenHands' own Python (>= 3.12; openhands_env.py), by path,
and imports nothing of agentaccel:

    python openhands_runner.py --base-url URL --workspace DIR --state DIR --task TEXT [--no-speculation] [--stream]
                               [--no-tag] [--context-date TEXT]

Prints one JSON line: the conversation's id, its final status, how many events it holds, how
many of them were errors, and how many chunks were streamed.
"""

import argparse
import json
import os
import sys

# run by path, this folder would come first on sys.path, and its openhands.py would hide OpenHands
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline, litellm's import would hang
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
# the window is the proxy's to tell (/v1/model/info); OpenHands refuses one under 16,384 tokens unless told
os.environ.setdefault("ALLOW_SHORT_CONTEXT_WINDOWS", "true")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True, help="the proxy, without /v1")
    parser.add_argument("--model", default="replay", help="the served model name")
    parser.add_argument("--provider", choices=("litellm_proxy", "openai"), default="litellm_proxy",
                        help="litellm_proxy/<model> at the proxy's root, or openai/<model> at its /v1")
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--state", required=True, help="where the conversation is persisted")
    parser.add_argument("--task", required=True)
    parser.add_argument("--stage", default="CodeActAgent", help="sent as the agent:<name> tag")
    parser.add_argument("--max-iterations", type=int, default=100)
    parser.add_argument("--no-speculation", action="store_true", help="ask the backend for plain decoding")
    parser.add_argument("--stream", action="store_true", help="stream the model's replies (tool calls included)")
    parser.add_argument("--no-tag", action="store_true", help="send no agent tag (as the SDK does by default)")
    parser.add_argument("--context-date", help="give the agent an AgentContext (the workspace's AGENTS.md loaded) "
                                               "whose <CURRENT_DATETIME> is this text")
    args = parser.parse_args()

    from openhands.sdk import LLM, Agent, AgentContext, Conversation, Tool
    from openhands.tools.file_editor import FileEditorTool
    from openhands.tools.terminal import TerminalTool
    from pydantic import SecretStr

    extra = {} if args.no_tag else {"tags": [f"agent:{args.stage}"]}
    if args.no_speculation:
        extra["vllm_xargs"] = {"speculate": False}  # what the vllm and replay backends read
    base_url = args.base_url.rstrip("/") + ("/v1" if args.provider == "openai" else "")
    llm = LLM(model=f"{args.provider}/{args.model}", base_url=base_url, api_key=SecretStr("none"),
              usage_id="agent", litellm_extra_body=extra, num_retries=0, temperature=0.0, stream=args.stream)
    context = None if args.context_date is None else AgentContext(load_project_skills=True,
                                                                   current_datetime=args.context_date)
    agent = Agent(llm=llm, tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)],
                  agent_context=context)
    chunks = []
    conversation = Conversation(agent=agent, workspace=args.workspace, persistence_dir=args.state,
                                max_iteration_per_run=args.max_iterations, visualizer=None,
                                token_callbacks=[chunks.append] if args.stream else None)
    conversation.send_message(args.task)
    status, error = "finished", None
    try:
        conversation.run()
        status = str(conversation.state.execution_status.value)
    except Exception as e:  # the backend refused a call (e.g. past the recording): the run ends there
        status, error = "error", f"{type(e).__name__}: {str(e)[:300]}"
    events = list(conversation.state.events)
    print(json.dumps({"id": str(conversation.id), "status": status, "events": len(events), "error": error,
                      "error_events": sum(1 for e in events if type(e).__name__ == "AgentErrorEvent"),
                      "streamed_chunks": len(chunks)}))


if __name__ == "__main__":
    main()
