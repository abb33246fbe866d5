"""Checks of request bodies: wrong types become a 400 naming the field, before anything is sent on."""

from __future__ import annotations

import json
import math
import re

from agentaccel import jsonfast
from agentaccel.errors import bad_request
from agentaccel.traces.records import without_lone_surrogates

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's way to write a UTF-16 surrogate

CHAT = "chat"
COMPLETIONS = "completions"


def parse_json(raw: bytes) -> dict:
    try:
        body = jsonfast.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}", code="invalid_json") from e
    except RecursionError as e:
        raise bad_request("the JSON body is nested too deeply", code="invalid_json") from e
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    # escaped pairs decode to one character; a lone half is text no UTF-8 upstream or store can take
    if (b"\\ud" in raw or b"\\uD" in raw) and _SURROGATE_ESCAPE.search(raw) \
            and without_lone_surrogates(body) is not body:
        raise bad_request("the body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which no "
                          "UTF-8 text can carry", code="invalid_unicode")
    return body


def check_field(body: dict, field: str, types: tuple, what: str, where: str = "") -> None:
    value = body.get(field)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise bad_request(f"'{where}{field}' must be {what}, got {type(value).__name__}", param=where + field,
                          code="invalid_type")


def validate(endpoint: str, body: dict) -> None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("'model' is required and must be a string", param="model", code="invalid_type")
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", param="messages", code="invalid_type")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]",
                                  code="invalid_type")
            content = m.get("content")
            if content is not None and not isinstance(content, str | list):
                raise bad_request(f"messages[{i}].content must be a string or a list of parts",
                                  param=f"messages[{i}].content", code="invalid_type")
            for k, part in enumerate(content if isinstance(content, list) else ()):
                if not isinstance(part, dict) or part.get("type") == "text" and not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{k}] must be a part object ({{'type': 'text', "
                                      "'text': '...'} or another type)", param=f"messages[{i}].content[{k}]",
                                      code="invalid_type")
            check_field(m, "tool_calls", (list,), "a list", f"messages[{i}].")
        check_field(body, "tools", (list,), "a list")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or isinstance(prompt, list) and not prompt:
            raise bad_request("'prompt' must be a string or a non-empty list", param="prompt", code="invalid_type")
    check_field(body, "stream", (bool,), "a boolean")
    check_field(body, "max_tokens", (int,), "an integer")
    check_field(body, "max_completion_tokens", (int,), "an integer")
    check_field(body, "n", (int,), "an integer")
    for field in ("temperature", "top_p"):
        check_field(body, field, (int, float), "a number")
        if isinstance(body.get(field), float) and not math.isfinite(body[field]):
            raise bad_request(f"'{field}' must be a finite number", param=field, code="invalid_value")
    for field in ("top_k", "seed"):
        check_field(body, field, (int,), "an integer")
    check_field(body, "stop", (str, list), "a string or a list of strings")
    check_field(body, "metadata", (dict,), "an object")
    check_field(body, "stream_options", (dict,), "an object")
    check_field(body, "vllm_xargs", (dict,), "an object")
    xargs = body.get("vllm_xargs") or {}
    check_field(xargs, "speculate", (bool,), "true or false", "vllm_xargs.")
    check_field(xargs, "stage", (str,), "a string", "vllm_xargs.")
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and body[field] < 1:
            raise bad_request(f"'{field}' must be >= 1", param=field, code="invalid_value")
