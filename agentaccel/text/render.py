"""Chat messages to prompt text.

`render_prompt` uses the model's chat template (jinja2) when it has one. Without one, and for
the per-message token cache, messages are rendered in the documented plain template, which is
ChatML (what SmolLM2 and many open models use):

    <|im_start|>{role}\\n{text}<|im_end|>\\n     one segment per message, then
    <|im_start|>assistant\\n                     the generation prompt

Segments split on special tokens, so the tokens of a prompt are its messages' cached token
segments back to back.
"""

from __future__ import annotations

import functools
from typing import Any

from agentaccel.text.messages import message_text

GENERATION_PROMPT = "<|im_start|>assistant\n"


def render_message(message: Any) -> str:
    if not isinstance(message, dict):  # a tool list
        from agentaccel.text.messages import canonical_json

        return canonical_json(message)
    return f"<|im_start|>{message.get('role', 'user')}\n{message_text(message)}<|im_end|>\n"


def _text_content(message: Any) -> Any:
    """A message whose content is a list of parts (as OpenHands and other clients send) with the
    parts' text joined: chat templates are written for string content."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        parts = message["content"]
        return {**message, "content": "".join(p.get("text", "") for p in parts if isinstance(p, dict))}
    return message


@functools.lru_cache(maxsize=16)
def _compiled(chat_template: str):
    """The template compiled once (compiling it for every call took a quarter of a replay server's
    time), or None when it does not compile."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.ChainableUndefined, keep_trailing_newline=True)
    try:
        return env.from_string(chat_template)
    except jinja2.TemplateError:
        return None


def render_prompt(messages: list[dict], chat_template: str | None = None, tools: list | None = None) -> str:
    template = _compiled(chat_template) if chat_template else None
    if template is not None:
        import jinja2

        try:
            return template.render(messages=[_text_content(m) for m in messages], tools=tools,
                                   add_generation_prompt=True)
        except (jinja2.TemplateError, TypeError):
            pass  # a template this renderer cannot run on these messages: fall back to the plain one
    return "".join(render_message(m) for m in messages) + GENERATION_PROMPT
