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

from agentaccel import jsonfast
from agentaccel.errors import APIError, bad_request
from agentaccel.proxy.accumulate import Accumulated, Accumulator
from agentaccel.proxy.apis import Api, StreamWriter, call_parts, sse
from agentaccel.proxy.validation import check_field
from agentaccel.text.dialects import DialectError, responses


class ResponsesApi(Api):
    name = "responses"

    def to_chat(self, body: dict) -> dict:
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
                    "messages": responses.chat_messages(body.get("instructions"), body["input"])}
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

    def reply(self, answer: Accumulated, body: dict, call_id: str) -> dict:
        response = _response(body, call_id, _status(answer), _usage(answer))
        response["output"] = _items(answer, call_id)
        return response

    def stream(self, body: dict, call_id: str, acc: Accumulator) -> StreamWriter:
        return _Events(body, call_id, acc)

    def error(self, error: APIError) -> dict:
        return error.body()


def _status(answer: Accumulated) -> str:
    return "incomplete" if answer.finish_reason == "length" else "completed"


def _usage(answer: Accumulated) -> dict:
    return {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": answer.cached_tokens},
            "output_tokens": answer.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.output_tokens}


def _response(body: dict, call_id: str, status: str, usage: dict | None) -> dict:
    """The Response object around its output (filled by the caller)."""
    return {
        "id": "resp_" + call_id.replace("-", ""), "object": "response", "created_at": int(time.time()),
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": body["model"], "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
        "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage, "user": None,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
    }


def _message_id(call_id: str) -> str:
    return "msg_" + call_id.replace("-", "")


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(call_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": _message_id(call_id), "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _function_call(call: dict, index: int, status: str) -> dict:
    """A chat tool call as a `function_call` item."""
    tool_id, name, arguments = call_parts(call, index)
    return {"type": "function_call", "id": "fc_" + tool_id, "call_id": tool_id, "name": name,
            "arguments": arguments if status == "completed" else "", "status": status}


def _items(answer: Accumulated, call_id: str) -> list[dict]:
    items = [_message(call_id, answer.text, "completed")] if answer.text else []
    return items + [_function_call(c, i, "completed") for i, c in enumerate(answer.tool_calls)]


class _Events(StreamWriter):
    """response.created, response.in_progress; per output item its added / delta / done events;
    response.completed (or response.incomplete) with the whole response and its usage."""

    def __init__(self, body: dict, call_id: str, acc: Accumulator) -> None:
        super().__init__(body, call_id, acc)
        self.text = ""  # the open message item's text so far
        self.sequence = 0
        self.started = False
        self.items: list[dict] = []  # the output so far, each item as it will be when done
        self.open: int | str | None = None  # "text", or the index of the call whose item is open

    def _event(self, kind: str, payload: dict) -> bytes:
        out = sse(kind, jsonfast.dumps({"type": kind, "sequence_number": self.sequence, **payload}))
        self.sequence += 1
        return out

    def _start(self) -> bytes:
        self.started = True
        response = _response(self.body, self.call_id, "in_progress", None)
        return self._event("response.created", {"response": response}) + \
            self._event("response.in_progress", {"response": response})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        index = len(self.items) - 1
        item = self.items[index]
        out = b""
        if self.open == "text":
            item.update(_message(self.call_id, self.text, "completed"))
            part = item["content"][0]
            out += self._event("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                             "content_index": 0, "text": part["text"],
                                                             "logprobs": []})
            out += self._event("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                              "content_index": 0, "part": part})
        else:
            item.update(_function_call(self.acc.call(self.open), self.open, "completed"))
            out += self._event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        self.open = None
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def feed(self, added: list[tuple]) -> bytes:
        out = b"" if self.started else self._start()
        for piece in added:
            if piece[0] == "text":
                if self.open != "text":
                    out += self._close()
                    self.text = ""
                    item = _message(self.call_id, "", "in_progress")
                    self.items.append(item)
                    self.open = "text"
                    index = len(self.items) - 1
                    out += self._event("response.output_item.added", {"output_index": index, "item": item})
                    out += self._event("response.content_part.added", {
                        "item_id": item["id"], "output_index": index, "content_index": 0, "part": _text_part("")})
                self.text += piece[1]
                out += self._event("response.output_text.delta", {
                    "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0,
                    "delta": piece[1], "logprobs": []})
            elif piece[0] == "call":
                out += self._close()
                item = _function_call(self.acc.call(piece[1]), piece[1], "in_progress")
                self.items.append(item)
                self.open = piece[1]
                out += self._event("response.output_item.added", {"output_index": len(self.items) - 1, "item": item})
            else:
                out += self._event("response.function_call_arguments.delta", {
                    "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "delta": piece[2]})
        return out

    def finish(self) -> bytes:
        out = (b"" if self.started else self._start()) + self._close()
        answer = self.acc.finish()
        status = _status(answer)
        response = _response(self.body, self.call_id, status, _usage(answer))
        response["output"] = self.items
        return out + self._event("response.completed" if status == "completed" else "response.incomplete",
                                 {"response": response})

    def fail(self, error: APIError) -> bytes:
        return self._event("error", {"code": error.code, "message": error.message, "param": error.param})
