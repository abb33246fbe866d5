"""Which stage and session a request belongs to, and the body to forward without the fields only
the proxy understands.

Stage, first match wins: header `X-Agentaccel-Stage`; body `metadata.stage` or `metadata.tags`,
else top-level `tags` (litellm's conventions; OpenHands sends `agent:CodeActAgent` there, the
same rule the importers apply; the SDK's `litellm_extra_body={"tags": [...]}` gives top-level
ones); `vllm_xargs.stage`; a configured rule (regex over the system prompt); the prompt template
the request matches (proxy/discovery.py: `tmpl:...`, from a template's second call on); else, with
discovery off, a stable fingerprint of the system prompt; else "default". A client's request to
compact its conversation (Claude Code's, Codex's: text/compaction.py) is then filed under that
stage with `:compact` after it (`X-Agentaccel-Stage: codex` -> `codex:compact`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from agentaccel.errors import bad_request
from agentaccel.text.compaction import compaction_stage
from agentaccel.text.headers import header_text
from agentaccel.traces.stages import DEFAULT_STAGE, explicit_stage, system_fingerprint, system_prompt

STAGE_HEADER = "x-agentaccel-stage"
MAX_STAGE_LENGTH = 128  # a stage is a Prometheus label value and a tree in the engine: names stay short
# ours, litellm's, the routers'; then the agents' own: Claude Code's, Codex's (`session-id`)
SESSION_HEADERS = ("x-agentaccel-session", "x-litellm-session-id", "x-session-id", "x-claude-code-session-id",
                   "session-id")
# the agent clients' own session headers (Claude Code's, Codex's): the id their session logs hold too
CLIENT_SESSION_HEADERS = ("x-claude-code-session-id", "session-id")
# metadata keys the proxy consumes; anything else in metadata is forwarded untouched
_METADATA_KEYS = ("stage", "tags", "session_id", "litellm_session_id")
_SESSION_METADATA = ("session_id", "litellm_session_id")


@dataclass(frozen=True)
class StageRule:
    stage: str
    pattern: re.Pattern

    @classmethod
    def parse(cls, spec: str) -> StageRule:
        """`NAME=REGEX` (the regex is searched in the system prompt)."""
        name, sep, regex = spec.partition("=")
        if not sep or not name or not regex:
            raise ValueError(f"stage rule {spec!r}: expected NAME=REGEX")
        try:
            return cls(name, re.compile(regex))
        except re.error as e:
            raise ValueError(f"stage rule {spec!r}: bad regex ({e})") from e


@dataclass
class Tags:
    stage: str
    stage_source: str  # header, metadata, vllm_xargs, rule, template, system, default
    session_id: str | None


def client_session(headers: Mapping[str, str]) -> str | None:
    """The session id an agent client (Claude Code, Codex) sent in its own header: the id its log
    keeps the call under too, so that a call recorded live and the same call imported from that log
    are one (traces/client_keys.py). None from any other client: a pipeline's session id may name
    calls that answer alike at the same turn, which must stay apart."""
    return next((header_text(headers[h]) for h in CLIENT_SESSION_HEADERS if headers.get(h)), None)


def check_stage(name: str, where: str) -> str:
    """A client-chosen stage name, refused (400) unless printable and at most MAX_STAGE_LENGTH long."""
    if not name.isprintable() or len(name) > MAX_STAGE_LENGTH:
        raise bad_request(f"{where}: a stage name is at most {MAX_STAGE_LENGTH} printable characters "
                          f"(got {len(name)}{', with unprintable ones' if not name.isprintable() else ''})",
                          param=where, code="invalid_stage")
    return name


def _text_header(value: str, name: str) -> str:
    """A header that names something (a stage), as text: its bytes read as UTF-8, else as Latin-1
    (HTTP's historical charset, and what Python's http.client sends for a str value: `sql-été` from
    `requests` arrives so). Bytes that start with a UTF-16 byte-order mark are neither: refused, not
    quietly the stage "ÿþ…" (C1 controls, also not text, are refused as unprintable by check_stage)."""
    text = header_text(value)
    if text is value and value.startswith(("\xff\xfe", "\xfe\xff")):  # kept as Latin-1, and UTF-16's mark
        raise bad_request(f"{name}: the header's bytes are UTF-16 (they start with a byte-order mark); send the "
                          "name as UTF-8", param=name, code="invalid_header")
    return text


def resolve(headers: Mapping[str, str], body: Mapping, rules: list[StageRule], fingerprint: bool = True,
            discover: Callable[[Mapping], str | None] | None = None) -> Tags:
    """`discover`: the stage discovery's lookup (None: off); when on, the fingerprint is not used
    (a system prompt with a date in it would give every run a stage of its own)."""
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else None
    session = next((header_text(headers[h]) for h in SESSION_HEADERS if headers.get(h)), None)
    if session is None and metadata:
        session = next((str(metadata[k]) for k in _SESSION_METADATA if metadata.get(k)), None)

    def tags(stage: str, source: str) -> Tags:
        return Tags(compaction_stage(stage, body.get("messages")), source, session)

    if headers.get(STAGE_HEADER):
        return tags(check_stage(_text_header(headers[STAGE_HEADER], "X-Agentaccel-Stage"), "X-Agentaccel-Stage"),
                    "header")
    tagged = explicit_stage(metadata) or explicit_stage({"tags": body.get("tags")})
    if tagged:
        return tags(check_stage(tagged, "metadata"), "metadata")
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and isinstance(xargs.get("stage"), str) and xargs["stage"]:
        return tags(check_stage(xargs["stage"], "vllm_xargs.stage"), "vllm_xargs")
    system = system_prompt(body)
    if system is not None:
        for rule in rules:
            if rule.pattern.search(system):
                return tags(rule.stage, "rule")
    if discover is not None:
        found = discover(body)
        return tags(found, "template") if found else tags(DEFAULT_STAGE, "default")
    if system is not None and fingerprint:
        return tags(system_fingerprint(system), "system")
    return tags(DEFAULT_STAGE, "default")


# Not passed on: hop-by-hop and framing headers (the proxy's own client sets them), and ours.
_NOT_FORWARDED = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
                  "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding", "content-type",
                  "user-agent", "cookie"}


def forward_headers(headers: Mapping[str, str], keep_authorization: bool) -> dict[str, str]:
    """Client headers worth passing upstream (provider-specific ones like OpenAI-Organization).
    `Authorization` goes on only when the proxy takes no key of its own and the upstream has none
    configured: then the client's key is the upstream's."""
    out = {}
    for name, value in headers.items():
        name = name.lower()
        if name in _NOT_FORWARDED or name.startswith("x-agentaccel-") or (name in ("authorization", "x-api-key")
                                                                          and not keep_authorization):
            continue
        out[name] = header_text(value)  # goes out as UTF-8: the bytes the client sent, when they were UTF-8
    if "x-api-key" in out:  # an Anthropic client's key: the upstream speaks chat, and reads a bearer token
        key = out.pop("x-api-key")
        out.setdefault("authorization", f"Bearer {key}")
    return out


SPECULATE_HEADER = "x-agentaccel-speculate"


def speculation_asked(headers: Mapping[str, str], body: dict) -> dict:
    """The body with `vllm_xargs.speculate` false when the `X-Agentaccel-Speculate: false` header
    asks for plain decoding: what a client that cannot add body fields (Claude Code, Codex: their
    settings add headers) sends for a baseline call."""
    value = headers.get(SPECULATE_HEADER)
    if value is None:
        return body
    asked = value.strip().lower()
    if asked not in ("false", "true"):
        raise bad_request(f"X-Agentaccel-Speculate: expected true or false, got {value!r}",
                          param="X-Agentaccel-Speculate", code="invalid_header")
    if asked == "true":
        return body
    xargs = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
    return {**body, "vllm_xargs": {**xargs, "speculate": False}}


def strip_proxy_fields(body: dict) -> dict:
    """A copy of the body without what only the proxy understands (it would confuse upstreams)."""
    out = dict(body)
    out.pop("tags", None)  # litellm's top-level tags: a stage here, an unknown parameter to OpenAI
    metadata = out.get("metadata")
    if isinstance(metadata, dict):
        rest = {k: v for k, v in metadata.items() if k not in _METADATA_KEYS}
        if rest:
            out["metadata"] = rest
        else:
            out.pop("metadata")
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict):
        rest = {k: v for k, v in xargs.items() if k != "stage"}
        if rest:
            out["vllm_xargs"] = rest
        else:
            out.pop("vllm_xargs")
    return out
