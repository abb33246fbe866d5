"""Text that crosses an HTTP header, both ways.

Reading: Starlette hands a header's bytes over as Latin-1 text, so a client's UTF-8
(`X-Agentaccel-Stage: sql-été`) would read as `sql-Ã©tÃ©`, a stage apart from the same name in
`metadata.stage`. A value that is valid UTF-8 is read as UTF-8; anything else stays Latin-1 (what
clients that encode headers as Latin-1 meant).

Writing: a client chooses its session id freely (in the body: any JSON string), and it goes to
routers and upstreams in headers. A value that cannot travel as it is (control characters, space
at either end that HTTP would strip, longer than a header should be) goes as a digest of itself:
routers only need the same value for the same session, and a header can never be refused.
"""

from __future__ import annotations

import hashlib

MAX_HEADER_TEXT = 256  # characters a value may have and still travel as it is


def header_text(value: str) -> str:
    """A header value as the client meant it: UTF-8 when its bytes are UTF-8, else Latin-1."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def header_value(text: str) -> str:
    """`text` as it may go into a header: itself when it can (printable, no space at either end,
    at most MAX_HEADER_TEXT characters; sent as UTF-8), else `sha256-` and a digest of it."""
    if text.isprintable() and text == text.strip() and len(text) <= MAX_HEADER_TEXT:
        return text
    return "sha256-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
