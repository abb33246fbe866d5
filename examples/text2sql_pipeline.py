"""A multi-stage text-to-SQL pipeline through the agentaccel proxy, with the official `openai` client.

Stages (each tagged with the `X-Agentaccel-Stage` header, so each gets its own suffix tree):
classify -> schema-link -> sql (N candidates) -> combine, over Spider dev questions.

    agentaccel serve &                                  # the embedded model on 127.0.0.1:8000
    python examples/text2sql_pipeline.py --questions 5  # then watch per-stage acceptance grow

Questions and schemas come from ../shared/traces/text2sql/spider (or --traces DIR).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from openai import OpenAI


def schema_text(db: dict) -> str:
    columns: dict[int, list[str]] = {}
    for table, column in db["column_names_original"][1:]:
        columns.setdefault(table, []).append(column)
    return "\n".join(f"{name}({', '.join(columns.get(i, []))})" for i, name in enumerate(db["table_names_original"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the proxy's --api-key, if it has one")
    parser.add_argument("--model", default=None, help="default: the first model the proxy lists")
    parser.add_argument("--traces", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "traces")
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--candidates", type=int, default=2, help="SQL candidates per question")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    spider = args.traces / "text2sql" / "spider"
    questions = json.loads((spider / "dev.json").read_text())[: args.questions]
    schemas = {db["db_id"]: schema_text(db) for db in json.loads((spider / "tables.json").read_text())}
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    session = f"text2sql-{int(time.time())}"
    spent: dict[str, float] = {}

    def ask(stage: str, prompt: str) -> str:
        t0 = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens, temperature=0,
            extra_headers={"X-Agentaccel-Stage": stage, "X-Agentaccel-Session": session})
        spent[stage] = spent.get(stage, 0.0) + time.perf_counter() - t0
        return reply.choices[0].message.content or ""

    for i, q in enumerate(questions):
        schema, question = schemas[q["db_id"]], q["question"]
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
