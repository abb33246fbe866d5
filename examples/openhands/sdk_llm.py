"""The OpenHands SDK's LLM, pointed at the agentaccel proxy (what `agentaccel openhands-config`
prints), sends one completion through it and prints the reply and the proxy's stage counters.

OpenHands is not a dependency of agentaccel: it needs Python >= 3.12 and runs in its own
environment, talking HTTP to the proxy as any user's agent does:

    uv venv --python 3.12 .openhands && uv pip install --python .openhands openhands-sdk openhands-tools
    agentaccel serve &
    .openhands/bin/python examples/openhands/sdk_llm.py
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
import warnings

# litellm (inside OpenHands) fetches a model price list at import unless told not to; offline it hangs
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
# OpenHands reads the model's window from the proxy and refuses one under 16,384 tokens (the bundled
# model's is 8,192) unless told that a short window is meant
os.environ.setdefault("ALLOW_SHORT_CONTEXT_WINDOWS", "true")
# a local model has no price in litellm's list: OpenHands warns on every call that it cannot cost it
warnings.filterwarnings("ignore", message="Cost calculation failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the proxy (default: %(default)s)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model (default: %(default)s)")
    parser.add_argument("--api-key", default="none", help="the proxy's --api-key, if it has one")
    args = parser.parse_args()
    try:
        from openhands.sdk import LLM, Message, TextContent
        from pydantic import SecretStr
    except ImportError:
        sys.exit("error: this example needs the OpenHands SDK, which runs in its own Python >= 3.12 environment:\n"
                 "  uv venv --python 3.12 .openhands && uv pip install --python .openhands openhands-sdk "
                 "openhands-tools\n  .openhands/bin/python examples/openhands/sdk_llm.py")

    # the agent:<name> tag becomes the call's stage (openhands:CodeActAgent), so the agent's calls get
    # their own suffix trees; a condenser LLM would carry its own tag
    llm = LLM(model=f"litellm_proxy/{args.model}", base_url=args.base_url, api_key=SecretStr(args.api_key),
              usage_id="agent", litellm_extra_body={"tags": ["agent:CodeActAgent"]}, max_output_tokens=48,
              temperature=0.0)
    question = Message(role="user", content=[TextContent(text="Write a bash command that lists Python files.")])
    try:
        reply = llm.completion([question])
    except Exception as e:  # litellm raises its own connection errors; say what to do, not a traceback
        sys.exit(f"error: no answer from the proxy at {args.base_url} ({type(e).__name__}); start one with "
                 "`agentaccel serve`")
    print("reply:", " ".join(part.text for part in reply.message.content if hasattr(part, "text")))
    with urllib.request.urlopen(args.base_url.rstrip("/") + "/metrics") as metrics:
        for line in metrics.read().decode().splitlines():
            if line.startswith("agentaccel_requests_total"):
                print(line)


if __name__ == "__main__":
    main()
