"""A 30-turn agent session as chat JSONL (an agent reading a project's files one by one), for
`bench agent --recorded --ttft`: `python scripts/lab/thirty_turn_session.py session.jsonl`."""

import json
import random
import sys

rng = random.Random(7)
names = "parse load store index query plan fetch merge split score rank cache flush retry encode decode".split()


def source(k):
    lines = [f"# module {k}: helpers for the {names[k % len(names)]} step", "import os", "import json", ""]
    for f in range(2):
        a, b = rng.choice(names), rng.choice(names)
        lines += [
            f"def {a}_{b}_{k}_{f}(items, limit={rng.randint(1, 99)}):",
            f'    """{a.title()} then {b} at most `limit` items."""',
            f"    out = [x for x in items if x.get('{a}') is not None][:limit]",
            f"    return sorted(out, key=lambda x: x.get('{b}', 0))",
            "",
        ]
    return "\n".join(lines)


system = (
    "You are a coding agent. You read files with the `read` tool and answer questions about the project. "
    "Read only what you need; cite file names in your answer.\n"
    + "Rules:\n"
    + "\n".join(
        f"- Rule {i}: keep tool calls small, one file at a time, and explain each step briefly." for i in range(30)
    )
)
messages = [
    {"role": "system", "content": system},
    {
        "role": "user",
        "content": "Read the modules src/m0.py to src/m28.py one by one and tell me which one defines the most helpers.",
    },
]
rows = []
for k in range(30):
    if k < 29:
        reply = {
            "role": "assistant",
            "content": f"Reading src/m{k}.py.",
            "tool_calls": [
                {
                    "id": f"call_{k}",
                    "type": "function",
                    "function": {"name": "read", "arguments": json.dumps({"path": f"src/m{k}.py"})},
                }
            ],
        }
    else:
        reply = {"role": "assistant", "content": "Every module defines two helpers; none defines more than the others."}
    rows.append(
        json.dumps(
            {
                "messages": [*messages, reply],
                "stage": "agent",
                "model": "recorded",
                "metadata": {"session": "thirty-turns", "instance_id": "thirty-turns"},
            }
        )
    )
    messages = [*messages, reply]
    if k < 29:
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": source(k)})
open(sys.argv[1] if len(sys.argv) > 1 else "session.jsonl", "w").write("\n".join(rows) + "\n")
