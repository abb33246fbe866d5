"""SWE-agent `.traj` files: `history` is the exact chat the model saw; each non-demo assistant
message is one call, its prompt every message before it (demonstrations included: the model saw them)."""

from __future__ import annotations

import re
from pathlib import Path

from agentaccel.traces.formats.common import chat_message, load_json
from agentaccel.traces.formats.conversation import calls_from_conversation
from agentaccel.traces.records import FormatError, Session, digest

_MODEL_DIR = re.compile(r"SWE-agent_(?P<model>[^/]+)")


def parse_traj(path: Path) -> list[Session]:
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("history"), list):
        raise FormatError("a .traj file must be an object with a `history` list")
    history = data["history"]
    messages = []
    for i, m in enumerate(history):
        msg = chat_message(m, f"history[{i}]")
        if m.get("agent"):
            msg["agent"] = m["agent"]
        if m.get("is_demo"):
            msg["is_demo"] = True
        messages.append(msg)
    found = _MODEL_DIR.search(str(path.resolve()))
    model = found.group("model") if found else None
    prompt_view = [{k: v for k, v in m.items() if k not in ("agent", "is_demo")} for m in messages]
    calls = calls_from_conversation(messages, keep=lambda m: not m.get("is_demo"), model=model)
    for call in calls:  # prompts without our bookkeeping keys
        call.messages = prompt_view[: call.source_offset]
    stats = (data.get("info") or {}).get("model_stats") or {}
    key = digest("swe-agent-traj", path.stem, model, prompt_view[:2], len(messages))
    return [Session(key=key, framework="swe-agent", calls=calls, model=model,
                    metadata={"instance_id": path.stem, "model_stats": stats or None})]
