"""OpenHands logs.

* V0 per-call completion logs (`logs/completions/**/*.json`): `{messages, response, args, kwargs,
  timestamp, cost}`; in prompt-based tool mode `messages`/`response` hold what the model really
  saw and produced (`fncall_*` is the converted view), so those are used.
* SDK (1.x) logs: `{messages, tools, kwargs, response, cost, timestamp, latency_sec,
  usage_summary, context_window}`; in prompt mode `raw_messages`/`raw_response` are the model's view.
* Evaluation `output.jsonl` and saved trajectories: openhands_events.py.
* Mock `prompt_NNN.log` / `response_NNN.log` pairs (a folder is one session).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentaccel.traces.formats.common import assistant_response, chat_message, load_json
from agentaccel.traces.records import Call, FormatError, Session, digest
from agentaccel.traces.stages import explicit_stage

SDK_KEYS = ("latency_sec", "usage_summary", "context_window", "raw_messages", "raw_response")


def is_completion_log(data: Any) -> bool:
    return isinstance(data, dict) and "messages" in data and "response" in data


def _response_message(response: Any, where: str) -> tuple[dict, dict]:
    """(choices[0].message, the response object) from a litellm/OpenAI ModelResponse dump."""
    if isinstance(response, str):
        return {"role": "assistant", "content": response}, {}
    if not isinstance(response, dict):
        raise FormatError(f"{where}: `response` must be a ModelResponse object or text")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise FormatError(f"{where}: `response.choices` is missing or empty")
    message = choices[0].get("message") or {}
    if not isinstance(message, dict):
        raise FormatError(f"{where}: `response.choices[0].message` is not an object")
    return {"role": "assistant", "content": message.get("content"), "tool_calls": message.get("tool_calls")}, response


def parse_completion_log(path: Path) -> list[Session]:
    data = load_json(path)
    if not is_completion_log(data):
        raise FormatError("an OpenHands completion log needs `messages` and `response`")
    sdk = any(k in data for k in SDK_KEYS)
    use_raw = sdk and data.get("raw_messages") is not None and data.get("raw_response") is not None
    raw_messages = data["raw_messages"] if use_raw else data["messages"]
    if not isinstance(raw_messages, list):
        raise FormatError("`messages` must be a list")
    messages = [chat_message(m, f"message {i}") for i, m in enumerate(raw_messages)]
    reply, response = _response_message(data["raw_response"] if use_raw else data["response"], "response")
    text, tool_calls = assistant_response(reply)
    kwargs = data.get("kwargs") if isinstance(data.get("kwargs"), dict) else {}
    metadata = kwargs.get("metadata") if isinstance(kwargs.get("metadata"), dict) else {}
    extra = kwargs.get("extra_body") if isinstance(kwargs.get("extra_body"), dict) else {}
    if "tags" not in metadata and isinstance(extra.get("tags"), list):  # the SDK's litellm_extra_body
        metadata = {**metadata, "tags": extra["tags"]}
    usage = response.get("usage") or {}
    finish = (response.get("choices") or [{}])[0].get("finish_reason") if response else None
    model = response.get("model") or kwargs.get("model")
    # Per-call files of one run share their folder (logs/completions/<run>/...): that is the session.
    session_key = digest("openhands-completions", str(path.parent.name), metadata.get("session_id"))
    call = Call(
        messages=messages, response=text, tool_calls=tool_calls, tools=data.get("tools") or kwargs.get("tools"),
        stage=explicit_stage(metadata), model=model, created_at=_float(data.get("timestamp")),
        finish_reason=finish, prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        latency=_float(data.get("latency_sec")),
        metadata={"file": path.name, "cost": data.get("cost"), **({"tags": metadata["tags"]} if "tags" in metadata
                                                                  else {}),
                  "position": _position(data)},
    )
    return [Session(key=session_key, framework="openhands", calls=[call], model=model,
                    metadata={"log_format": "sdk" if sdk else "v0"})]


def _position(data: dict) -> int:
    """Calls of one run live in separate files: their order is their timestamp (in µs)."""
    stamp = _float(data.get("timestamp"))
    return int(round(stamp * 1e6)) if stamp is not None else 0


def _float(value) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def parse_mock_folder(folder: Path) -> list[Session]:
    """prompt_NNN.log / response_NNN.log pairs: a flattened prompt and the raw completion."""
    prompts = sorted(folder.glob("prompt_*.log"))
    if not prompts:
        raise FormatError("no prompt_NNN.log files")
    calls = []
    for prompt_file in prompts:
        number = prompt_file.stem.split("_", 1)[1]
        response_file = folder / f"response_{number}.log"
        if not response_file.exists():
            raise FormatError(f"{prompt_file.name} has no {response_file.name}")
        try:
            prompt, response = prompt_file.read_text(encoding="utf-8"), response_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{prompt_file.name}: not UTF-8 text") from e
        calls.append(Call(messages=[{"role": "user", "content": prompt}], response=response,
                          source_offset=int(number) if number.isdigit() else 0))
    agent = folder.parent.name
    for call in calls:
        call.metadata = {"agent": agent}
    key = digest("openhands-mock", agent, folder.name, calls[0].messages)
    return [Session(key=key, framework="openhands", calls=calls, metadata={"test": folder.name})]
