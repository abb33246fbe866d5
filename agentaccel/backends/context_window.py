"""A request over its model's context window, as every backend reports it.

Agents recover from a conversation that outgrew the window by compacting or condensing it, and
each learns that it must from the API's own error: litellm (OpenHands) raises
`ContextWindowExceededError` on `code: "context_length_exceeded"` or OpenAI's wording ("maximum
context length"), Codex compacts on the code. So every backend raises `ContextOverflow`: a 400
with that code and OpenAI's words, and the sizes, from which the proxy words the other APIs'
errors (proxy/context_errors.py). An upstream's own context error (vLLM words it several ways
across versions, other servers theirs) is recognised and raised the same way (`from_upstream`).
"""

from __future__ import annotations

import re

from agentaccel.errors import APIError

CODE = "context_length_exceeded"


class ContextOverflow(APIError):
    """`window`: the model's context in tokens (prompt and answer together); `prompt`: the
    request's prompt tokens; `completion`: the answer tokens it asked room for (None: unknown).
    `detail`: an upstream's own message, kept where its sizes could not be read."""

    def __init__(self, window: int | None, prompt: int | None, completion: int | None = None,
                 detail: str | None = None) -> None:
        self.window, self.prompt, self.completion = window, prompt, completion
        super().__init__(400, _openai_message(window, prompt, completion, detail), param="messages", code=CODE)


def _openai_message(window: int | None, prompt: int | None, completion: int | None, detail: str | None) -> str:
    # The phrase "maximum context length" is what detectors look for (litellm reads the message, not the code)
    if window is None:
        return f"This request exceeds the model's maximum context length: {detail or 'too many tokens'}"
    if prompt is None:
        return f"This model's maximum context length is {window} tokens. However, this request is longer: {detail}"
    if completion is None:  # only the prompt's size is known (it alone fills the window)
        return (f"This model's maximum context length is {window} tokens. However, your messages resulted in "
                f"{prompt} tokens. Please reduce the length of the messages.")
    return (f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
            "Please reduce the length of the messages or completion.")


def check(window: int | None, prompt: int, completion: int, *, ceiling: bool) -> int:
    """The answer length a request gets within `window`, or ContextOverflow. `ceiling`: the
    asked length is a most, not a demand (the Messages API requires one; an OpenAI request that
    named none), shortened to what the prompt leaves; a prompt that leaves no token is refused."""
    if window is None:
        return completion
    if ceiling:
        if prompt >= window:
            raise ContextOverflow(window, prompt, 1)  # at least one token must fit after the prompt
        return min(completion, window - prompt)
    if prompt + completion > window:
        raise ContextOverflow(window, prompt, completion)
    return completion


# How upstreams word a context overflow: (pattern, which group is the window, the prompt, the
# answer's length). vLLM's wordings over its versions first, then the phrases other servers use.
_UPSTREAM = [
    (re.compile(r"maximum context length is (\d+) tokens\. However, you requested (\d+) tokens \((\d+) in the "
                r"messages, (\d+) in the completion\)"), 1, 3, 4),
    (re.compile(r"maximum context length is (\d+) tokens\. However, you requested (\d+) output tokens and your "
                r"prompt contains (?:at least )?(\d+) input tokens"), 1, 3, 2),
    (re.compile(r"maximum context length is (\d+) tokens\. However, your (?:prompt contains|request has|messages "
                r"resulted in) (?:at least )?(\d+) (?:input )?tokens"), 1, 2, None),
    (re.compile(r"maximum context length is (\d+) tokens and your request has (\d+) input tokens \((\d+) >"), 1, 2, 3),
    (re.compile(r"prompt \(length (\d+)\)(?: plus the number of requested output tokens \(at least 1\))? is longer "
                r"than the maximum model length of (\d+)"), 2, 1, None),
    (re.compile(r"Input length \((\d+)\) exceeds model's maximum context length \((\d+)\)"), 2, 1, None),
    (re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum"), 2, 1, None),
]
_PHRASES = ("maximum context length", "context length exceeded", "context_length_exceeded", "context window",
            "longer than the maximum model length", "maximum model length", "prompt is too long",
            "exceeds the context", "input is too long")


def from_upstream(status: int, message: str, code: object, window: int | None) -> ContextOverflow | None:
    """An upstream's 4xx read as a context overflow (None: some other error). `window`: the
    model's context as the upstream listed it, where its message does not say."""
    if not 400 <= status < 500:
        return None
    for pattern, w, p, c in _UPSTREAM:
        m = pattern.search(message)
        if m:
            return ContextOverflow(int(m.group(w)), int(m.group(p)), int(m.group(c)) if c else None)
    lowered = message.lower()
    if code == CODE or any(phrase in lowered for phrase in _PHRASES):
        return ContextOverflow(window, None, None, detail=message)
    return None
