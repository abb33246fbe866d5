"""`agentaccel export-traces`: calls as OpenAI-style chat JSONL that `import-traces` reads back
(same session keys, positions and live calls' ids, so re-importing into the same store adds nothing;
baseline calls keep their flag, so no reader learns them after an export and re-import either)."""

from __future__ import annotations

from pathlib import Path

from agentaccel.text.messages import reply_content
from agentaccel.traces.formats.chat_jsonl import chat_jsonl_line
from agentaccel.traces.store import TraceStore


def export_calls(store: TraceStore, out: Path, stage: str | None = None, tenant: str | None = None) -> int:
    """`tenant`: one tenant's calls (tenants.BASE: the base's); each call's tenant travels along."""
    keys = store.session_keys()
    tmp = out.with_suffix(out.suffix + ".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for call in store.iter_calls(stage=stage, tenant=tenant, baselines=True):
            reply = {"role": "assistant", "content": reply_content(call.response, call.tool_calls)}
            if call.tool_calls:
                reply["tool_calls"] = call.tool_calls
            f.write(chat_jsonl_line(call.messages, reply, stage=call.stage, model=call.model,
                                    metadata={"session": keys[call.session_id], "position": call.position,
                                              "created_at": call.created_at, "source": call.source_file,
                                              **({"tenant": call.tenant} if call.tenant else {}),
                                              **({"baseline": True} if call.baseline else {}),
                                              **_identity(call)}))
            n += 1
    tmp.replace(out)
    return n


def _identity(call) -> dict:
    """A call recorded live is known by the proxy's id for it (store.call_identity): it travels along."""
    call_id = (call.metadata or {}).get("call_id")
    return {"call_id": call_id} if call_id else {}
