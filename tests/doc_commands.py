"""The shell commands a document shows its reader: its fenced code blocks, line by line, for the
tests that run or parse them (tests/test_first_hour.py: the README; tests/test_benchmarks_commands.py:
docs/BENCHMARKS.md)."""

from __future__ import annotations

import re


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def shell_commands(block: str) -> list[str]:
    """A bash block's commands in order: continued lines (`\\` at the end) joined, comments dropped."""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        command = re.sub(r"(^|\s+)#.*$", "", line).strip()
        if command:
            commands.append(command)
    return commands
