"""Text-to-SQL pipeline outputs (parsed outputs, not raw text, so each call's response is the
step's output as the pipeline recorded it; prompts are the questions where the dataset has them).

* RSL-SQL: one session per question, one call per step output, each step its own stage. Two
  layouts: `BIRD_DEV/<model>/step1..step4/` folders, or one flat folder (as its Spider results are
  published) with `LLM.json` beside `step_N_sql.txt` files (`example.json`, the few-shot examples
  it was prompted with, is input, not output).
* DAIL-SQL (`results/*.txt`): one predicted SQL per line, aligned with Spider dev (BIRD_* files
  with BIRD dev).
* BIRD mini-dev predictions (`predict_*.json`: {"id": "SQL\\t----- bird -----\\tdb_id"}).
"""

from __future__ import annotations

import json
from pathlib import Path

from agentaccel.traces.formats.common import find_upwards, load_json
from agentaccel.traces.records import Call, FormatError, Session, digest

BIRD_MARK = "\t----- bird -----\t"

RSL_STEPS = [  # (file inside the model folder, stage, how a line/entry becomes the response)
    ("step1/LLM.json", "rsl-sql:schema-linking", "json"),
    ("step1/preliminary_sql.txt", "rsl-sql:preliminary-sql", "line"),
    ("step2/augmentation.json", "rsl-sql:augmentation", "json"),
    ("step2/step_2_information_augmentation.txt", "rsl-sql:augmented-sql", "line"),
    ("step3/step_3_binary.txt", "rsl-sql:binary-selection", "line"),
    ("step4/final_sql.txt", "rsl-sql:self-correction", "line"),
]


RSL_FLAT_STEPS = [  # the flat layout: the same stages, one file each
    ("LLM.json", "rsl-sql:schema-linking", "json"),
    ("step_1_sql.txt", "rsl-sql:preliminary-sql", "line"),
    ("augmentation.json", "rsl-sql:augmentation", "json"),
    ("step_2_sql.txt", "rsl-sql:augmented-sql", "line"),
    ("step_3_sql.txt", "rsl-sql:binary-selection", "line"),
    ("step_4_sql.txt", "rsl-sql:self-correction", "line"),
]


def _is_flat_rsl(folder: Path) -> bool:
    return (folder / "LLM.json").is_file() and any(folder.glob("step_[1-4]_sql.txt"))


def is_rsl_folder(folder: Path) -> bool:
    return (folder / "step1" / "LLM.json").is_file() or _is_flat_rsl(folder)


def _bird_questions(start: Path) -> dict[int, dict]:
    path = find_upwards(start, "text2sql/bird_mini_dev/mini_dev_sqlite.json") or find_upwards(
        start, "bird_mini_dev/mini_dev_sqlite.json")
    if path is None:
        return {}
    return {int(q["question_id"]): q for q in json.loads(path.read_text())}


def _question_prompt(question: dict | None, fallback: str) -> list[dict]:
    if not question:
        return [{"role": "user", "content": fallback}]
    text = f"Database: {question.get('db_id')}\nQuestion: {question.get('question')}"
    if question.get("evidence"):
        text += f"\nEvidence: {question['evidence']}"
    return [{"role": "user", "content": text}]


def parse_rsl_folder(folder: Path) -> list[Session]:
    outputs: list[tuple[str, list[str]]] = []
    flat = not (folder / "step1").is_dir()
    for rel, stage, kind in RSL_FLAT_STEPS if flat else RSL_STEPS:
        path = folder / rel
        if not path.exists():
            if flat and rel != "LLM.json":  # a flat folder holds the steps its run wrote
                continue
            raise FormatError(f"missing {rel}")
        if kind == "json":
            data = load_json(path)
            if not isinstance(data, list):
                raise FormatError(f"{rel}: expected a JSON list (one entry per question)")
            items = [json.dumps(x, ensure_ascii=False) for x in data]
        else:
            items = path.read_text(encoding="utf-8").splitlines()
        outputs.append((stage, items))
    counts = {len(items) for _, items in outputs}
    if len(counts) != 1:
        raise FormatError(f"steps disagree on the number of questions: {sorted(counts)}")
    # BIRD layout: row n is BIRD dev question n (its text is found beside it when the dataset is);
    # the flat layout names no dataset, so its prompts stay placeholders
    questions = {} if flat else _bird_questions(folder)
    label = "RSL-SQL question" if flat else "BIRD dev question"
    model = folder.name
    sessions = []
    for n in range(counts.pop()):
        qid = n
        prompt = _question_prompt(questions.get(qid), f"{label} {qid}")
        calls = [Call(messages=prompt, response=items[n], stage=stage, model=model, source_offset=n,
                      metadata={"question_id": qid}) for stage, items in outputs]
        sessions.append(Session(key=digest("rsl-sql", model, qid), framework="rsl-sql", calls=calls, model=model,
                                metadata={"question_id": qid}))
    return sessions


def parse_dail_sql(path: Path) -> list[Session]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise FormatError("not UTF-8 text") from e
    bird = path.name.upper().startswith("BIRD")
    questions: list[dict] = []
    if not bird:
        dev = find_upwards(path.parent, "text2sql/spider/dev.json") or find_upwards(path.parent, "spider/dev.json")
        questions = json.loads(dev.read_text()) if dev else []
    calls = []
    for n, sql in enumerate(lines):
        q = questions[n] if n < len(questions) else None
        prompt = _question_prompt(q, f"{'BIRD' if bird else 'Spider'} dev question {n}")
        calls.append(Call(messages=prompt, response=sql, stage="dail-sql", model="gpt-4", source_offset=n))
    return [Session(key=digest("dail-sql", path.name, len(lines)), framework="dail-sql", calls=calls, model="gpt-4")]


def is_bird_predictions(data) -> bool:
    return isinstance(data, dict) and bool(data) and all(isinstance(v, str) for v in data.values()) and any(
        BIRD_MARK in v for v in list(data.values())[:5])


def parse_bird_predictions(path: Path) -> list[Session]:
    data = load_json(path)
    if not is_bird_predictions(data):
        raise FormatError("expected {question index: 'SQL\\t----- bird -----\\tdb_id'}")
    questions = list(_bird_questions(path.parent).values())
    model = path.stem.removeprefix("predict_mini_dev_")
    calls = []
    for key, value in data.items():
        sql = value.split(BIRD_MARK)[0]
        n = int(key) if key.isdigit() else 0
        q = questions[n] if n < len(questions) else None
        calls.append(Call(messages=_question_prompt(q, f"BIRD mini-dev question {key}"), response=sql,
                          stage="bird-sql", model=model, source_offset=n))
    return [Session(key=digest("bird-predictions", path.parent.name, path.name), framework="text2sql",
                    calls=calls, model=model)]
