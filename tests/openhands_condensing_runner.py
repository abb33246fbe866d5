"""An OpenHands SDK agent (terminal tool) whose history is kept within its model's window by the
SDK's summarizing condenser, as a user sets it up for a small model: run under OpenHands' own
Python by path (tests/test_long_sessions.py), it imports nothing of agentaccel.

    python openhands_condensing_runner.py --base-url URL --workspace DIR --task TEXT --window N --max-size N

The agent's calls carry the `agent:CodeActAgent` tag, the condenser's `agent:condenser` (their
stages in the proxy). Prints one JSON line: the final status, the events, the condensations, and
the message the agent finished with.
"""

import argparse
import json
import os
import sys

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline, litellm's import would hang
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True, help="the proxy, without /v1")
    parser.add_argument("--model", default="replay")
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--window", type=int, required=True, help="the model's context (max_input_tokens)")
    parser.add_argument("--max-size", type=int, required=True, help="the condenser's most events")
    args = parser.parse_args()

    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.sdk.context.condenser import LLMSummarizingCondenser
    from openhands.tools.terminal import TerminalTool
    from pydantic import SecretStr

    def llm(usage: str, tag: str) -> LLM:
        return LLM(model=f"litellm_proxy/{args.model}", base_url=args.base_url, api_key=SecretStr("none"),
                   usage_id=usage, litellm_extra_body={"tags": [f"agent:{tag}"]}, num_retries=0, temperature=0.0,
                   max_input_tokens=args.window, max_output_tokens=512)

    condenser = LLMSummarizingCondenser(llm=llm("condenser", "condenser"), max_size=args.max_size, keep_first=2)
    agent = Agent(llm=llm("agent", "CodeActAgent"), tools=[Tool(name=TerminalTool.name)], condenser=condenser)
    conversation = Conversation(agent=agent, workspace=args.workspace, max_iteration_per_run=60, visualizer=None)
    conversation.send_message(args.task)
    status, error = "finished", None
    try:
        conversation.run()
        status = str(conversation.state.execution_status.value)
    except Exception as e:  # a refused call ends the run there
        status, error = "error", f"{type(e).__name__}: {str(e)[:500]}"
    events = list(conversation.state.events)
    finished = [e for e in events if type(e).__name__ == "ActionEvent" and getattr(e, "tool_name", "") == "finish"]
    print(json.dumps({"status": status, "error": error, "events": len(events),
                      "condensations": sum(1 for e in events if type(e).__name__ == "Condensation"),
                      "finished_with": finished[-1].action.message if finished else None}))


if __name__ == "__main__":
    main()
