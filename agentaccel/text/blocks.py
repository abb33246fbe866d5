"""Blocks of an Anthropic conversation that a chat model cannot be sent as they are, read the one
way for a live request (`/v1/messages`) and for an imported log (Claude Code's transcripts): what
the provider ran itself (server tools: web search, web fetch, code execution, MCP calls, and
their results), documents and search results, citations on text, a model's hidden reasoning.

A conversation carries them in its history, which its client re-sends on every turn and cannot
change: each is shown to the model as text where it holds any a model can read (a search's
titles and links, a code run's output, a text document), and left out where it holds none (a
model's signed or redacted reasoning, a PDF's bytes, an uploaded file). `render` says which,
and callers count both (`/metrics`: agentaccel_history_blocks_total).
"""

from __future__ import annotations

from agentaccel.text.messages import canonical_json

# A model's reasoning, signed or redacted by its provider, and files kept in the provider's
# containers: nothing a model here can be shown.
DROPPED = frozenset({"thinking", "redacted_thinking", "container_upload"})
# Calls the provider ran itself: the call as a line of text, as a model reading the history sees it.
SERVER_CALLS = frozenset({"server_tool_use", "mcp_tool_use"})
# Keys whose text a result block shows; the rest (encrypted content, base64 bytes, ids) it does not
_SHOWN_KEYS = ("title", "url", "text", "stdout", "stderr", "error_code", "page_age")


def known(kind: str) -> bool:
    """Whether `kind` is a block type `render` reads (the others are the caller's to judge)."""
    return kind in DROPPED or kind in SERVER_CALLS or kind in ("document", "search_result") or \
        kind.endswith("_tool_result")


def render(block: dict) -> str | None:
    """The text a model is shown for a block `known` reads, or None when it is left out."""
    kind = block.get("type")
    if kind in DROPPED:
        return None
    if kind in SERVER_CALLS:
        server = f" ({block['server_name']})" if isinstance(block.get("server_name"), str) else ""
        return f"[{block.get('name') or kind}{server} called with {canonical_json(block.get('input') or {})}]"
    if kind == "document":
        return _document(block)
    if kind == "search_result":
        head = " ".join(str(block[k]) for k in ("title", "source") if isinstance(block.get(k), str))
        return f"[search result: {head}]\n{_texts(block.get('content'))}".rstrip()
    # a server tool's result (web_search_tool_result, code_execution_tool_result, mcp_tool_result, ...)
    name = kind.removesuffix("_tool_result") if isinstance(kind, str) else "tool"
    error = " (error)" if block.get("is_error") else ""
    body = _texts(block.get("content"))
    return f"[{name} result{error}]" + (f"\n{body}" if body else "")


def _document(block: dict) -> str | None:
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    title = block.get("title") if isinstance(block.get("title"), str) else None
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif source.get("type") == "content":
        text = _texts(source.get("content"))
    else:  # a PDF's bytes, a link, an uploaded file: no text to show, only that it was there
        what = title or source.get("url") or source.get("media_type") or source.get("type") or "a document"
        return f"[document: {what} (not readable here)]"
    context = f"\n{block['context']}" if isinstance(block.get("context"), str) else ""
    return f"[document{': ' + title if title else ''}]{context}\n{text}"


def _texts(value, depth: int = 0) -> str:
    """The readable text in a result's content, in order: strings, and the values of the keys a
    reader is shown (titles, links, text, a run's output), one per line."""
    if depth > 8:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(t for t in (_texts(v, depth + 1) for v in value) if t)
    if not isinstance(value, dict):
        return ""
    if value.get("type") == "document":
        return _document(value) or ""
    shown = [str(value[k]) for k in _SHOWN_KEYS if isinstance(value.get(k), str | int) and value.get(k) != ""]
    if isinstance(value.get("return_code"), int) and value["return_code"] != 0:
        shown.append(f"exit code {value['return_code']}")
    nested = _texts(value.get("content"), depth + 1)
    return "\n".join([*shown, nested] if nested else shown)
