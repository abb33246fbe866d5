"""Text-to-SQL pipelines' real prompt templates (DIN-SQL, DAIL-SQL, RSL-SQL, CHESS; `templates/`,
see SOURCES.md there) filled with Spider and BIRD mini-dev questions and schemas, each stage's
prompt one user message and no system message, as these pipelines send them. The true stage of a
call is the template that made it. Outputs are the real ones where a run of that pipeline is in
the shared traces (DAIL-SQL's GPT-4 SQL, RSL-SQL's step outputs), else the question's gold SQL."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from agentaccel.traces.formats.text2sql import parse_rsl_folder

TEMPLATES = Path(__file__).with_name("templates")


@dataclass
class LabelledCall:
    messages: list[dict]
    output: str
    truth: str  # the template (stage) that made the prompt
    session: str  # one question's run of the pipeline, or one agent run


@cache
def template(name: str) -> str:
    return (TEMPLATES / f"{name}.txt").read_text(encoding="utf-8")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- schemas, as each pipeline prints them ----------------------------------------------------
@dataclass
class Schema:
    tables: list[str]
    columns: list[tuple[int, str, str]]  # (table index, column, type)
    primary: list[int]
    foreign: list[tuple[int, int]]

    @classmethod
    def of(cls, entry: dict) -> Schema:
        cols = [(t, c, ty) for (t, c), ty in zip(entry["column_names_original"], entry["column_types"], strict=True)]
        primary = [p for k in entry["primary_keys"] for p in (k if isinstance(k, list) else [k])]
        return cls(entry["table_names_original"], cols, primary, [tuple(f) for f in entry["foreign_keys"]])

    def fields(self) -> str:  # DIN-SQL: "Table t, columns = [*,a,b]"
        out = ""
        for i, t in enumerate(self.tables):
            out += f"Table {t}, columns = [*," + ",".join(c for ti, c, _ in self.columns if ti == i) + "]\n"
        return out

    def _column(self, i: int) -> str:
        ti, c, _ = self.columns[i]
        return f"{self.tables[ti]}.{c}"

    def foreign_keys(self) -> str:
        return "[" + ",".join(f"{self._column(a)} = {self._column(b)}" for a, b in self.foreign) + "]"

    def primary_keys(self) -> str:
        return "[" + ",".join(self._column(p) for p in self.primary) + "]\n"

    def ddl(self) -> str:  # CREATE TABLE statements (DAIL-SQL, CHESS, RSL-SQL)
        out = []
        for i, t in enumerate(self.tables):
            cols = [f"    {c} {ty}{' primary key' if j in self.primary else ''}"
                    for j, (ti, c, ty) in enumerate(self.columns) if ti == i]
            fks = [f"    foreign key ({self.columns[a][1]}) references {self.tables[self.columns[b][0]]}"
                   f"({self.columns[b][1]})" for a, b in self.foreign if self.columns[a][0] == i]
            out.append(f"CREATE TABLE {t} (\n" + ",\n".join(cols + fks) + "\n)")
        return "\n".join(out)


@cache
def schemas(path: str) -> dict[str, Schema]:
    return {e["db_id"]: Schema.of(e) for e in json.loads(Path(path).read_text())}


def spider(traces: Path, limit: int | None) -> tuple[list[dict], dict[str, Schema]]:
    questions = json.loads((traces / "text2sql/spider/dev.json").read_text())[:limit]
    return questions, schemas(str(traces / "text2sql/spider/tables.json"))


def bird(traces: Path, limit: int) -> tuple[list[dict], dict[str, Schema]]:
    questions = json.loads((traces / "text2sql/bird_mini_dev/mini_dev_sqlite.json").read_text())[:limit]
    return questions, schemas(str(traces / "text2sql/bird_mini_dev/dev_tables.json"))


_WORDS = re.compile(r"[a-z]+")


def words_of(questions: list[dict]) -> list[set[str]]:
    return [set(_WORDS.findall(q["question"].lower())) for q in questions]


def similar(questions: list[dict], words: list[set[str]], n: int, k: int) -> list[dict]:
    """k other questions (of other databases) most like question n (`words`: `words_of(questions)`):
    per-question few-shot examples, as DAIL-SQL and RSL-SQL choose them."""
    pool = [i for i, q in enumerate(questions) if q["db_id"] != questions[n]["db_id"]]
    pool.sort(key=lambda i: -len(words[n] & words[i]))
    return [questions[i] for i in pool[:k]]


def sql_of(q: dict) -> str:
    return q.get("query") or q.get("SQL") or ""


# --- DIN-SQL (Spider) --------------------------------------------------------------------------
def din_sql(traces: Path, limit: int) -> list[LabelledCall]:
    questions, dbs = spider(traces, limit)
    college = dbs["college_2"]
    out = []
    for n, q in enumerate(questions):
        s, text, sql = dbs[q["db_id"]], q["question"], sql_of(q)
        links = "[" + ", ".join(sorted(set(re.findall(r"\b\w+\.\w+\b", sql)))[:6]) + "]"
        with_keys = college.fields() + "Foreign_keys = " + college.foreign_keys() + "\n" + s.fields() + \
            "Foreign_keys = " + s.foreign_keys() + "\n\n"
        think = "\nA: Let’s think step by step."
        prompts = {
            "schema_linking": "# Find the schema_links for generating SQL queries for each question based on the "
                              "database schema and Foreign keys.\n" + template("din_sql.schema_linking") + s.fields()
                              + "Foreign_keys = " + s.foreign_keys() + "\n" + f'Q: "{text}"' + think,
            "classification": "# For the given question, classify it as EASY, NON-NESTED, or NESTED based on nested "
                              "queries and JOIN.\n\nif need nested queries: predict NESTED\nelif need JOIN and "
                              "don't need nested queries: predict NON-NESTED\nelif don't need JOIN and don't need "
                              "nested queries: predict EASY\n\n" + with_keys + template("din_sql.classification")
                              + f'Q: "{text}\nschema_links: {links}' + think,
        }
        upper = sql.upper()
        if upper.count("SELECT") > 1:
            prompts["hard"] = ("# Use the intermediate representation and the schema links to generate the SQL queries "
                               "for each of the questions.\n" + with_keys + template("din_sql.hard")
                               + f'Q: "{text}"\nschema_links: {links}\nA: Let\'s think step by step. "{text}" can be '
                               f'solved by knowing the answer to the following sub-question "{text}".'
                               '\nThe SQL query for the sub-question"')
        elif "JOIN" in upper:
            prompts["medium"] = ("# Use the the schema links and Intermediate_representation to generate the SQL "
                                 "queries for each of the questions.\n" + with_keys + template("din_sql.medium")
                                 + f'Q: "{text}\nSchema_links: {links}\nA: Let’s think step by step.')
        else:
            prompts["easy"] = ("# Use the the schema links to generate the SQL queries for each of the questions.\n"
                               + college.fields() + s.fields() + "\n" + template("din_sql.easy")
                               + f'Q: "{text}\nSchema_links: {links}\nSQL:')
        prompts["self_correction"] = (template("din_sql.debugger_instruction") + s.fields() + "Foreign_keys = "
                                      + s.foreign_keys() + "\n" + "Primary_keys = " + s.primary_keys()
                                      + f"#### Question: {text}\n#### SQLite SQL QUERY\n{sql}\n"
                                      "#### SQLite FIXED SQL QUERY\nSELECT")
        for stage, prompt in prompts.items():
            out.append(LabelledCall(user(prompt), sql, f"din-sql:{stage}", f"din-sql/{n}"))
    return out


# --- DAIL-SQL (Spider; its GPT-4 predictions as outputs) -----------------------------------------
def dail_sql(traces: Path, limit: int) -> list[LabelledCall]:
    everything, dbs = spider(traces, None)  # examples come from every question, as from a training set
    questions = everything[:limit]
    predicted = (traces / "text2sql/dail_sql/results/DAIL-SQL+GPT-4.txt").read_text().splitlines()
    words = words_of(everything)
    out = []
    for n, q in enumerate(questions):
        examples = "".join(f"/* Answer the following: {e['question']} */\n{sql_of(e)}\n\n"
                           for e in similar(everything, words, n, 5))
        prompt = ("/* Some SQL examples are provided based on similar problems: */\n" + examples
                  + "/* Given the following database schema: */\n" + dbs[q["db_id"]].ddl() + "\n\n"
                  + f"/* Answer the following: {q['question']} */\nSELECT ")
        out.append(LabelledCall(user(prompt), predicted[n] if n < len(predicted) else sql_of(q), "dail-sql",
                                f"dail-sql/{n}"))
    return out


# --- RSL-SQL (BIRD mini-dev; the shared run's step outputs) ---------------------------------------
_RSL_TEMPLATES = {  # the importer's stage -> the template its prompt is made from
    "rsl-sql:schema-linking": "rsl_sql.table_aug_instruction",
    "rsl-sql:preliminary-sql": "rsl_sql.sql_generation_instruction",
    "rsl-sql:augmentation": "rsl_sql.key_word_aug_instruction",
    "rsl-sql:augmented-sql": "rsl_sql.sql_generation_instruction",
    "rsl-sql:binary-selection": "rsl_sql.binary_prompt",
    "rsl-sql:self-correction": "rsl_sql.self_correction_prompt",
}


def rsl_sql(traces: Path, limit: int) -> list[LabelledCall]:
    questions, dbs = bird(traces, limit)
    words = words_of(questions)
    runs = sorted((traces / "text2sql/rsl_sql/BIRD_DEV").iterdir())
    recorded = parse_rsl_folder(runs[0]) if runs else []  # the importer's reading: one session a question
    out = []
    for n, q in enumerate(questions):
        s, qid = dbs[q["db_id"]], int(q["question_id"])
        table_info = ("### Sqlite SQL tables, with their properties:\n" + s.ddl()
                      + "\n### Foreign key information of Sqlite SQL tables, used for table joins:\n"
                      + s.foreign_keys())
        examples = "".join(f"### {e['question']}\n{sql_of(e)}\n\n" for e in similar(questions, words, n, 3))
        ask = f"\n\n### definition: {q['evidence']}\n### Question: {q['question']}"
        answer = ("### Answer the question by sqlite SQL query only and with no explanation. You must minimize SQL "
                  "execution time while ensuring correctness.\n")
        outputs = {c.stage: c.response for c in recorded[qid].calls} if qid < len(recorded) else {}
        for stage, name in _RSL_TEMPLATES.items():
            output = outputs.get(stage, sql_of(q))
            if stage == "rsl-sql:binary-selection":
                candidates = f"### sql1: {sql_of(q)} \n### result1: [] \n### sql2: {output} \n### result2: []"
                prompt = template(name).replace("{table_info}", examples + answer + table_info + ask).replace(
                    "{candidate_sql}", candidates)
            elif stage in ("rsl-sql:schema-linking", "rsl-sql:augmentation"):
                prompt = template(name) + "\n\n" + table_info + ask
            else:
                prompt = template(name) + "\n\n" + examples + answer + table_info + ask
            out.append(LabelledCall(user(prompt), output, f"rsl-sql:{name.split('.', 1)[1]}", f"rsl-sql/{n}"))
    return out


# --- CHESS (BIRD mini-dev) ------------------------------------------------------------------------
_CHESS = ["extract_keywords", "select_tables", "select_columns", "generate_candidate_one",
          "generate_candidate_two", "revise_one"]


def chess(traces: Path, limit: int) -> list[LabelledCall]:
    questions, dbs = bird(traces, limit)
    out = []
    for n, q in enumerate(questions):
        fill = {"{QUESTION}": q["question"], "{HINT}": q["evidence"], "{DATABASE_SCHEMA}": dbs[q["db_id"]].ddl(),
                "{QUERY}": sql_of(q), "{RESULT}": "[]"}
        for name in _CHESS:
            prompt = template(f"chess.{name}")
            for slot, value in fill.items():
                prompt = prompt.replace(slot, value)
            out.append(LabelledCall(user(prompt), sql_of(q), f"chess:{name}", f"chess/{n}"))
    return out


TEXT2SQL = {"din-sql": din_sql, "dail-sql": dail_sql, "rsl-sql": rsl_sql, "chess": chess}
