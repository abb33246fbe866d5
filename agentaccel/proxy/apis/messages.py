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
from collections import Counter

from agentaccel import jsonfast
from agentaccel.errors import APIError, bad_request
from agentaccel.proxy.accumulate import Accumulated, Accumulator
from agentaccel.proxy.apis import Api, Writer, sse
from agentaccel.proxy.apis.parts import Item
from agentaccel.proxy.context_errors import messages_wording
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

    def to_chat(self, body: dict, counts: Counter | None = None) -> dict:
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
            chat = {"model": body["model"], "messages": anthropic.chat_messages(body.get("system"), body["messages"],
                                                                             counts=counts),
                    "max_tokens": body["max_tokens"], "stream": bool(body.get("stream"))}
            tools = anthropic.chat_tools(body.get("tools"))
            choice = anthropic.chat_tool_choice(body.get("tool_choice"), body.get("tools"))
        except DialectError as e:
            raise bad_request(str(e), param=e.param, code="invalid_value") from None
        if tools:
            chat["tools"] = tools
            if choice is not None:
                chat["tool_choice"] = choice
        for field in ("temperature", "top_p", "top_k", "vllm_xargs"):
            if body.get(field) is not None:
                chat[field] = body[field]
        session = session_of(body.get("metadata"))
        if session:
            chat["metadata"] = {"session_id": session}
        return chat

    counts_prompt = True  # message_start carries the prompt's tokens

    def stops(self, body: dict) -> list[str]:
        return list(body.get("stop_sequences") or [])

    def writer(self, body: dict, call_id: str, acc: Accumulator) -> Writer:
        return _Events(body, call_id, acc)

    def error(self, error: APIError) -> dict:
        kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": messages_wording(error)}}


def _id(call_id: str) -> str:
    return "msg_" + call_id.replace("-", "")


def tool_input(arguments: str) -> dict:
    """A call's arguments as an object (`tool_use.input`). Arguments a model wrote that are not a
    JSON object are kept whole under "arguments", never dropped (NaN and Infinity too: JSON has
    no such numbers, and no client could read them back)."""
    try:
        value = json.loads(arguments, parse_constant=_no_constant) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _stop(answer: Accumulated, body: dict) -> tuple[str, str | None]:
    if answer.finish_reason == "stop" and answer.matched_stop in (body.get("stop_sequences") or ()):
        return "stop_sequence", answer.matched_stop
    return _STOP.get(answer.finish_reason or "stop", "end_turn"), None


def _usage(answer: Accumulated, prompt_tokens: int | None = None) -> dict:
    prompt = answer.prompt_tokens if answer.usage is not None else prompt_tokens or 0
    return {"input_tokens": prompt - answer.cached_tokens, "output_tokens": answer.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": answer.cached_tokens}


def _event(kind: str, payload: dict) -> bytes:
    return sse(kind, jsonfast.dumps({"type": kind, **payload}))


def _block(item: Item) -> dict:
    """An output item as its content block in the whole message."""
    if item.kind == "text":
        return {"type": "text", "text": item.text}
    return {"type": "tool_use", "id": item.id, "name": item.name, "input": tool_input(item.text)}


class _Events(Writer):
    """message_start (with the prompt's tokens), then per output item its content block: a text
    block's text_delta events as the text comes; a tool_use block's input in one input_json_delta
    when the call is complete (only then is it known whether the model wrote a JSON object, and
    the whole answer's `input` is that same object); message_delta with the stop reason and
    usage; message_stop."""

    def __init__(self, body: dict, call_id: str, acc: Accumulator) -> None:
        super().__init__(body, call_id, acc)
        self.started = False
        self.message: dict | None = None

    def _start(self) -> bytes:
        self.started = True
        message = {"id": _id(self.call_id), "type": "message", "role": "assistant", "model": self.body["model"],
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**_usage(Accumulated(), self.prompt_tokens), "output_tokens": 0}}
        return _event("message_start", {"message": message})

    def _moves(self, moves: list) -> bytes:
        out = b""
        for move in moves:
            item = move[1]
            if move[0] == "open":
                block = {"type": "text", "text": ""} if item.kind == "text" else {**_block(item), "input": {}}
                out += _event("content_block_start", {"index": item.position, "content_block": block})
            elif move[0] == "delta":
                if item.kind == "text":
                    out += _event("content_block_delta", {"index": item.position,
                                                          "delta": {"type": "text_delta", "text": move[2]}})
            else:
                if item.kind == "call":
                    out += _event("content_block_delta", {"index": item.position, "delta": {
                        "type": "input_json_delta", "partial_json": jsonfast.dumps(tool_input(item.text)).decode()}})
                out += _event("content_block_stop", {"index": item.position})
        return out

    def feed(self, added: list[tuple]) -> bytes:
        return (b"" if self.started else self._start()) + self._moves(self.parts.take(added))

    def finish(self) -> bytes:
        out = b"" if self.started else self._start()
        added: list[tuple] = []
        self.acc.end(added)
        out += self._moves(self.parts.take(added) + self.parts.end())
        answer = self.acc.finish()
        stop_reason, stop_sequence = _stop(answer, self.body)
        usage = _usage(answer, self.prompt_tokens)
        self.message = {"id": _id(self.call_id), "type": "message", "role": "assistant", "model": self.body["model"],
                        "content": [_block(item) for item in self.parts.items], "stop_reason": stop_reason,
                        "stop_sequence": stop_sequence, "usage": usage}
        out += _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                        "usage": usage})
        return out + _event("message_stop", {})

    def whole(self) -> dict:
        return self.message

    def fail(self, error: APIError) -> bytes:
        return sse("error", jsonfast.dumps(MessagesApi().error(error)))
