"""The Anthropic Messages API (`POST /v1/messages`), as Claude Code calls it.

Read: `model`, `messages`, `max_tokens` (required, as the API requires it), `system`, `tools`,
`tool_choice`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `metadata.user_id`
(Claude Code writes a JSON object there whose `session_id` is the session), `vllm_xargs`.
Accepted and ignored, as a local model has nothing to do with them: `thinking`,
`context_management`, `output_config`, `service_tier`, cache control on blocks, `container`,
`mcp_servers`. Answers and events are the API's own (message_start ... message_stop); errors are
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json

from agentaccel import jsonfast
from agentaccel.errors import APIError, bad_request
from agentaccel.proxy.accumulate import Accumulated, Accumulator
from agentaccel.proxy.apis import Api, StreamWriter, call_parts, sse
from agentaccel.proxy.validation import check_field
from agentaccel.text.dialects import DialectError, anthropic

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
# Anthropic's error types by HTTP status (its documented set; 529 is its "overloaded")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def session_of(metadata) -> str | None:
    """The session a Messages request names: Claude Code's `metadata.user_id` is a JSON object
    holding `session_id` (older versions wrote `user_..._session_<id>`)."""
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user, str):
        return None
    if user.startswith("{"):
        try:
            found = json.loads(user).get("session_id")
        except (json.JSONDecodeError, AttributeError):
            return None
        return found if isinstance(found, str) and found else None
    _, sep, tail = user.rpartition("_session_")
    return tail if sep and tail else None


class MessagesApi(Api):
    name = "messages"

    def to_chat(self, body: dict) -> dict:
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise bad_request("'model' is required and must be a string", param="model", code="invalid_type")
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad_request("'max_tokens' is required and must be an integer >= 1", param="max_tokens",
                              code="invalid_value")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise bad_request("'messages' must be a non-empty list", param="messages", code="invalid_type")
        check_field(body, "stream", (bool,), "a boolean")
        check_field(body, "stop_sequences", (list,), "a list of strings")
        check_field(body, "top_k", (int,), "an integer")
        check_field(body, "metadata", (dict,), "an object")
        for field in ("temperature", "top_p"):
            check_field(body, field, (int, float), "a number")
        stops = body.get("stop_sequences") or []
        if not all(isinstance(s, str) and s for s in stops):
            raise bad_request("'stop_sequences' must be a list of non-empty strings", param="stop_sequences",
                              code="invalid_type")
        try:
            chat = {"model": body["model"], "messages": anthropic.chat_messages(body.get("system"), body["messages"]),
                    "max_tokens": body["max_tokens"], "stream": bool(body.get("stream"))}
            tools = anthropic.chat_tools(body.get("tools"))
            choice = anthropic.chat_tool_choice(body.get("tool_choice"))
        except DialectError as e:
            raise bad_request(str(e), param=e.param, code="invalid_value") from None
        if tools:
            chat["tools"] = tools
            if choice is not None:
                chat["tool_choice"] = choice
        for field in ("temperature", "top_p", "top_k", "vllm_xargs"):
            if body.get(field) is not None:
                chat[field] = body[field]
        if stops:
            chat["stop"] = stops
        session = session_of(body.get("metadata"))
        if session:
            chat["metadata"] = {"session_id": session}
        return chat

    def reply(self, answer: Accumulated, body: dict, call_id: str) -> dict:
        content = [{"type": "text", "text": answer.text}] if answer.text else []
        for i, call in enumerate(answer.tool_calls):
            tool_id, name, arguments = call_parts(call, i)
            content.append({"type": "tool_use", "id": tool_id, "name": name, "input": tool_input(arguments)})
        stop_reason, stop_sequence = _stop(answer, body)
        return {"id": _id(call_id), "type": "message", "role": "assistant", "model": body["model"], "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(answer)}

    def stream(self, body: dict, call_id: str, acc: Accumulator) -> StreamWriter:
        return _Events(body, call_id, acc)

    def error(self, error: APIError) -> dict:
        kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}


def _id(call_id: str) -> str:
    return "msg_" + call_id.replace("-", "")


def tool_input(arguments: str) -> dict:
    """A call's arguments as an object (`tool_use.input`). Arguments a model wrote that are not a
    JSON object are kept whole under "arguments", never dropped."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def _stop(answer: Accumulated, body: dict) -> tuple[str, str | None]:
    if answer.finish_reason == "stop" and answer.matched_stop in (body.get("stop_sequences") or ()):
        return "stop_sequence", answer.matched_stop
    return _STOP.get(answer.finish_reason or "stop", "end_turn"), None


def _usage(answer: Accumulated) -> dict:
    return {"input_tokens": answer.prompt_tokens - answer.cached_tokens, "output_tokens": answer.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": answer.cached_tokens}


def _event(kind: str, payload: dict) -> bytes:
    return sse(kind, jsonfast.dumps({"type": kind, **payload}))


class _Events(StreamWriter):
    """message_start, then a content block per run of text and per tool call (text_delta,
    input_json_delta), message_delta with the stop reason and usage, message_stop."""

    def __init__(self, body: dict, call_id: str, acc: Accumulator) -> None:
        super().__init__(body, call_id, acc)
        self.started = False
        self.block = -1  # the index of the open content block (-1: none yet)
        self.open = None  # "text", or the index of the call whose block is open

    def _start(self) -> bytes:
        self.started = True
        message = {"id": _id(self.call_id), "type": "message", "role": "assistant", "model": self.body["model"],
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return _event("message_start", {"message": message})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _event("content_block_stop", {"index": self.block})

    def _open(self, what, block: dict) -> bytes:
        out = self._close()
        self.block += 1
        self.open = what
        return out + _event("content_block_start", {"index": self.block, "content_block": block})

    def feed(self, added: list[tuple]) -> bytes:
        out = b"" if self.started else self._start()
        for piece in added:
            if piece[0] == "text":
                if self.open != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out += _event("content_block_delta", {"index": self.block,
                                                      "delta": {"type": "text_delta", "text": piece[1]}})
            elif piece[0] == "call":
                tool_id, name, _ = call_parts(self.acc.call(piece[1]), piece[1])
                out += self._open(piece[1], {"type": "tool_use", "id": tool_id, "name": name, "input": {}})
            else:
                out += _event("content_block_delta", {"index": self.block,
                                                      "delta": {"type": "input_json_delta", "partial_json": piece[2]}})
        return out

    def finish(self) -> bytes:
        out = (b"" if self.started else self._start()) + self._close()
        answer = self.acc.finish()
        stop_reason, stop_sequence = _stop(answer, self.body)
        out += _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                        "usage": _usage(answer)})
        return out + _event("message_stop", {})

    def fail(self, error: APIError) -> bytes:
        return sse("error", jsonfast.dumps(MessagesApi().error(error)))
