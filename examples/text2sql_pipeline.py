"""A multi-stage text-to-SQL pipeline through the agentaccel proxy, with the official `openai` client.

Stages (each tagged with the `X-Agentaccel-Stage` header, so each gets its own suffix tree):
classify -> schema-link -> sql (N candidates) -> combine.

    agentaccel serve &                                  # the embedded model on 127.0.0.1:8000
    python examples/text2sql_pipeline.py --questions 3  # then watch per-stage acceptance grow

Questions and schemas: the text-to-SQL questions agentaccel carries (its `bench vllm` workload),
or Spider's dev set with `--spider DIR` (a folder holding Spider's dev.json and tables.json).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from importlib.resources import files
from pathlib import Path

from openai import APIConnectionError, OpenAI

BUNDLED = Path(str(files("agentaccel.bench") / "workloads" / "text2sql_questions.json"))


def bundled_questions(path: Path) -> list[tuple[str, str]]:
    """(schema, question) pairs from the shipped file."""
    data = json.loads(path.read_text())
    return [(data["databases"][q["db"]], q["question"]) for q in data["questions"]]


def spider_questions(folder: Path) -> list[tuple[str, str]]:
    """(schema, question) pairs from Spider's dev.json and tables.json."""
    schemas = {}
    for db in json.loads((folder / "tables.json").read_text()):
        columns: dict[int, list[str]] = {}
        for table, column in db["column_names_original"][1:]:
            columns.setdefault(table, []).append(column)
        schemas[db["db_id"]] = "\n".join(f"{name}({', '.join(columns.get(i, []))})"
                                         for i, name in enumerate(db["table_names_original"]))
    return [(schemas[q["db_id"]], q["question"]) for q in json.loads((folder / "dev.json").read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the proxy (default: %(default)s)")
    parser.add_argument("--api-key", default="none", help="the proxy's --api-key, if it has one")
    parser.add_argument("--model", default=None, help="default: the first model the proxy lists")
    parser.add_argument("--spider", type=Path, default=None,
                        help="a folder with Spider's dev.json and tables.json (default: the shipped questions)")
    parser.add_argument("--questions", type=int, default=5, help="questions to run (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=2, help="SQL candidates per question (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=96, help="per call (default: %(default)s)")
    args = parser.parse_args()

    try:
        questions = (spider_questions(args.spider) if args.spider else bundled_questions(BUNDLED))[: args.questions]
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"error: cannot read the questions ({e})")
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    try:
        model = args.model or client.models.list().data[0].id
    except APIConnectionError:
        sys.exit(f"error: no proxy answering at {args.base_url}: start one with `agentaccel serve`")
    session = f"text2sql-{int(time.time())}"
    spent: dict[str, float] = {}

    def ask(stage: str, prompt: str) -> str:
        t0 = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens, temperature=0,
            extra_headers={"X-Agentaccel-Stage": stage, "X-Agentaccel-Session": session})
        spent[stage] = spent.get(stage, 0.0) + time.perf_counter() - t0
        return reply.choices[0].message.content or ""

    for i, (schema, question) in enumerate(questions):
        difficulty = ask("classify", f"Classify the difficulty of this SQL question as EASY, MEDIUM or HARD.\n"
                                     f"Question: {question}")
        link = ask("schema-link", f"Database schema:\n{schema}\n\nQuestion: {question}\n"
                                  "List the tables and columns needed to answer it.")
        candidates = [ask("sql", f"Database schema:\n{schema}\n\nQuestion: {question}\nDifficulty: {difficulty}\n"
                                 f"Relevant schema: {link}\nWrite SQL query number {k + 1}.")
                      for k in range(args.candidates)]
        listed = "\n".join(f"Candidate {k + 1}:\n{c}" for k, c in enumerate(candidates))
        final = ask("combine", f"Question: {question}\n{listed}\nOutput only the best final SQL query.")
        print(f"[{i + 1}/{len(questions)}] {question}\n  -> {' '.join(final.split())[:160]}")

    print("\nseconds per stage:", {stage: round(s, 2) for stage, s in spent.items()})
    metrics = client.with_options(base_url=args.base_url.removesuffix("/v1")).get("/metrics", cast_to=str)
    for line in str(metrics).splitlines():
        if re.match(r"agentaccel_(acceptance_rate|mean_accepted_length)\{", line):
            print(line)


if __name__ == "__main__":
    main()
