"""A request over its model's context window, in the words each API's clients recognise.

Every backend raises the one error (backends/context_window.ContextOverflow: 400,
`code: "context_length_exceeded"`, OpenAI's wording), and each API answers it as its own service
does, because each client decides to compact or condense its conversation on exactly that:

* chat completions: as raised. litellm's exception mapping (OpenHands, aider, ...) raises
  `ContextWindowExceededError` on the code or on "maximum context length";
* the Responses API: as raised: Codex compacts on `context_length_exceeded`;
* the Messages API: `invalid_request_error` with Anthropic's own message, "prompt is too long:
  N tokens > M maximum", which Claude Code parses (N - M is how far over it is) to compact.
"""

from __future__ import annotations

from agentaccel.backends.context_window import ContextOverflow
from agentaccel.errors import APIError


def messages_wording(error: APIError) -> str:
    """The Messages API's message for `error`: Anthropic's for a context overflow whose sizes
    are known, the error's own otherwise."""
    if not isinstance(error, ContextOverflow) or error.window is None or error.prompt is None:
        if isinstance(error, ContextOverflow):  # the sizes unknown: the phrase alone still tells the client
            return f"prompt is too long: {error.message}"
        return error.message
    # N > M must hold: a prompt that fills the window exactly is over it by the one token an answer needs
    tokens = error.prompt if error.prompt > error.window else error.prompt + max(error.completion or 0, 1)
    return f"prompt is too long: {tokens} tokens > {error.window} maximum"
