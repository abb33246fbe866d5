"""The OpenAI Responses API (`POST /v1/responses`), as Codex calls it.

Read: `model`, `input`, `instructions`, `tools` (functions, and namespaces of them),
`tool_choice`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format` (JSON
output), `prompt_cache_key` (Codex's conversation id: the session), `vllm_xargs`. Accepted and
ignored: `store` (this server keeps no responses: every answer says `"store": false`), `include`,
`reasoning`, `parallel_tool_calls`, `truncation`, `metadata`, `client_metadata`, `service_tier`,
`user`. Refused with a 400 naming it: `previous_response_id` and `background` (they need responses
kept by the server). Events are the API's own (response.created ... response.completed), each
with its `sequence_number`; errors the OpenAI shape.
"""

from __future__ import annotations

import time
from collections import Counter

from agentaccel import jsonfast
from agentaccel.errors import APIError, bad_request
from agentaccel.proxy.accumulate import Accumulated, Accumulator
from agentaccel.proxy.apis import Api, Writer, sse
from agentaccel.proxy.apis.parts import Item
from agentaccel.proxy.validation import check_field
from agentaccel.text.dialects import DialectError, responses


class ResponsesApi(Api):
    name = "responses"

    def to_chat(self, body: dict, counts: Counter | None = None) -> dict:
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise bad_request("'model' is required and must be a string", param="model", code="invalid_type")
        if body.get("input") is None:
            raise bad_request("'input' is required: a string or a list of items", param="input", code="invalid_type")
        for field in ("previous_response_id", "background"):
            if body.get(field):
                raise bad_request(f"'{field}' is not supported: this server keeps no responses; send the whole "
                                  "conversation in 'input' (with 'store': false)", param=field, code="unsupported")
        check_field(body, "stream", (bool,), "a boolean")
        check_field(body, "max_output_tokens", (int,), "an integer")
        check_field(body, "text", (dict,), "an object")
        check_field(body, "prompt_cache_key", (str,), "a string")
        for field in ("temperature", "top_p"):
            check_field(body, field, (int, float), "a number")
        if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] < 1:
            raise bad_request("'max_output_tokens' must be >= 1", param="max_output_tokens", code="invalid_value")
        try:
            chat = {"model": body["model"], "stream": bool(body.get("stream")),
                    "messages": responses.chat_messages(body.get("instructions"), body["input"],
                                                        counts=counts)}
            tools = responses.chat_tools(body.get("tools"))
            choice = responses.chat_tool_choice(body.get("tool_choice"))
        except DialectError as e:
            raise bad_request(str(e), param=e.param, code="invalid_value") from None
        if not chat["messages"]:
            raise bad_request("'input' holds no message a model can be shown", param="input", code="invalid_value")
        if tools:
            chat["tools"] = tools
            if choice is not None:
                chat["tool_choice"] = choice
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for field in ("temperature", "top_p", "vllm_xargs"):
            if body.get(field) is not None:
                chat[field] = body[field]
        form = (body.get("text") or {}).get("format")
        if isinstance(form, dict) and form.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: form[k] for k in ("name", "schema", "strict", "description") if k in form}}
        elif isinstance(form, dict) and form.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        if body.get("prompt_cache_key"):
            chat["metadata"] = {"session_id": body["prompt_cache_key"]}
        return chat

    def writer(self, body: dict, call_id: str, acc: Accumulator) -> Writer:
        return _Events(body, call_id, acc)

    def error(self, error: APIError) -> dict:
        return error.body()


# Why an answer is incomplete, by the chat finish reason that cut it (OpenAI's own reasons)
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _usage(answer: Accumulated) -> dict:
    return {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": answer.cached_tokens},
            "output_tokens": answer.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.output_tokens}


def _response(body: dict, call_id: str, created: int, status: str, usage: dict | None,
              reason: str | None = None) -> dict:
    """The Response object around its output (filled by the caller)."""
    return {
        "id": "resp_" + call_id.replace("-", ""), "object": "response", "created_at": created,
        "status": status, "error": None, "incomplete_details": {"reason": reason} if reason else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": body["model"], "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
        "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage, "user": None,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(item: Item, call_id: str, status: str) -> dict:
    """An output item as the Response carries it: a `message` of its text, or a `function_call`.
    Each has its own id (its place in the output), the same in its events and in the whole answer."""
    tag = f"{call_id.replace('-', '')}_{item.position}"
    done = status != "in_progress"
    if item.kind == "text":
        return {"type": "message", "id": "msg_" + tag, "status": status, "role": "assistant",
                "content": [_text_part(item.text)] if done else []}
    return {"type": "function_call", "id": "fc_" + tag, "call_id": item.id, "name": item.name,
            "arguments": item.text if done else "", "status": status}


class _Events(Writer):
    """response.created, response.in_progress; per output item its added / delta / done events;
    response.completed, or response.incomplete (its last item incomplete too) when the answer was
    cut short, with the whole response and its usage."""

    def __init__(self, body: dict, call_id: str, acc: Accumulator) -> None:
        super().__init__(body, call_id, acc)
        self.sequence = 0
        self.started = False
        self.reason: str | None = None  # why the answer is incomplete, once it ended so
        self.created = int(time.time())  # one time for the response, in its every event
        self.response: dict | None = None

    def _event(self, kind: str, payload: dict) -> bytes:
        out = sse(kind, jsonfast.dumps({"type": kind, "sequence_number": self.sequence, **payload}))
        self.sequence += 1
        return out

    def _start(self) -> bytes:
        self.started = True
        response = _response(self.body, self.call_id, self.created, "in_progress", None)
        return self._event("response.created", {"response": response}) + \
            self._event("response.in_progress", {"response": response})

    def _status(self, item: Item) -> str:
        return "incomplete" if self.reason and item is self.parts.items[-1] else "completed"

    def _moves(self, moves: list) -> bytes:
        out = b""
        for move in moves:
            item = move[1]
            where = {"item_id": _item(item, self.call_id, "in_progress")["id"], "output_index": item.position}
            if move[0] == "open":
                out += self._event("response.output_item.added", {"output_index": item.position,
                                                                  "item": _item(item, self.call_id, "in_progress")})
                if item.kind == "text":
                    out += self._event("response.content_part.added", {**where, "content_index": 0,
                                                                       "part": _text_part("")})
            elif move[0] == "delta":
                if item.kind == "text":
                    out += self._event("response.output_text.delta", {**where, "content_index": 0, "delta": move[2],
                                                                      "logprobs": []})
                else:
                    out += self._event("response.function_call_arguments.delta", {**where, "delta": move[2]})
            else:
                done = _item(item, self.call_id, self._status(item))
                if item.kind == "text":
                    out += self._event("response.output_text.done", {**where, "content_index": 0, "text": item.text,
                                                                     "logprobs": []})
                    out += self._event("response.content_part.done", {**where, "content_index": 0,
                                                                      "part": done["content"][0]})
                else:
                    out += self._event("response.function_call_arguments.done", {**where, "name": item.name,
                                                                                 "arguments": item.text})
                out += self._event("response.output_item.done", {"output_index": item.position, "item": done})
        return out

    def feed(self, added: list[tuple]) -> bytes:
        return (b"" if self.started else self._start()) + self._moves(self.parts.take(added))

    def finish(self) -> bytes:
        out = b"" if self.started else self._start()
        added: list[tuple] = []
        self.acc.end(added)
        moves = self.parts.take(added)
        answer = self.acc.finish()
        self.reason = _INCOMPLETE.get(answer.finish_reason or "")
        out += self._moves(moves + self.parts.end())
        status = "incomplete" if self.reason else "completed"
        self.response = _response(self.body, self.call_id, self.created, status, _usage(answer), self.reason)
        self.response["output"] = [_item(item, self.call_id, self._status(item)) for item in self.parts.items]
        return out + self._event("response." + status, {"response": self.response})

    def whole(self) -> dict:
        return self.response

    def fail(self, error: APIError) -> bytes:
        return self._event("error", {"code": error.code, "message": error.message, "param": error.param})
