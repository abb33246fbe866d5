"""Template discovery (traces/template_miner.py) on real pipelines' prompt templates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentaccel.bench.stage_bench import adjusted_rand
from agentaccel.bench.stage_sets import pipelines as pp
from agentaccel.traces.template_miner import MinerConfig, Signature, TemplateMiner, _core

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def discovered(calls: list[pp.LabelledCall], miner: TemplateMiner | None = None) -> list[int]:
    miner = miner or TemplateMiner(track_merges=True)
    found = [miner.observe_messages(c.messages).template for c in calls]
    return [id(miner.resolve(t)) for t in found]


def _schema(db: str, tables: int) -> str:
    return "\n".join(f"CREATE TABLE {db}_t{i} (\n  id integer primary key,\n  {db}_name_{i} text,\n"
                     f"  {db}_value_{i} real\n)" for i in range(tables))


def chess_calls(questions: int) -> list[pp.LabelledCall]:
    """CHESS's real templates, filled by question over three databases (each stage meets each)."""
    out = []
    for n in range(questions):
        db = ("concert", "airline", "school")[n * 3 // questions]
        fill = {"{QUESTION}": f"How many rows of {db} have value above {n}?", "{HINT}": f"value refers to {db}_value",
                "{DATABASE_SCHEMA}": _schema(db, 12), "{QUERY}": f"SELECT count(*) FROM {db}_t0", "{RESULT}": "[]"}
        for name in pp._CHESS:
            prompt = pp.template(f"chess.{name}")
            for slot, value in fill.items():
                prompt = prompt.replace(slot, value)
            out.append(pp.LabelledCall(pp.user(prompt), "", name, str(n)))
    return out


def test_every_stage_of_a_pipeline_without_system_prompt_is_found():
    calls = chess_calls(30)
    miner = TemplateMiner(track_merges=True)
    labels = discovered(calls, miner)
    assert adjusted_rand([c.truth for c in calls], labels) == 1.0
    assert len(miner.named) == len(pp._CHESS)
    assert all(name.startswith("tmpl:") and name.isprintable() and len(name) <= 64 for name in miner.named)
    # the two candidate generators open with the same four lines and still get apart
    assert len({labels[i] for i, c in enumerate(calls) if c.truth.startswith("generate_candidate")}) == 2


def test_a_stage_is_named_from_its_second_call_on():
    calls = chess_calls(3)
    miner = TemplateMiner(track_merges=True)
    stages = [miner.observe_messages(c.messages).stage for c in calls]
    first, later = stages[: len(pp._CHESS)], stages[len(pp._CHESS):]
    assert first == [None] * len(pp._CHESS)
    assert all(s and s.startswith("tmpl:") for s in later)
    assert len(set(later)) == len(pp._CHESS)


def test_a_slot_right_after_the_opening_is_one_template():
    """DAIL-SQL's shape: a fixed opening, then examples chosen per question, then the schema."""
    miner = TemplateMiner(track_merges=True)
    labels = []
    for n in range(40):
        examples = "".join(f"/* Answer the following: question {n}-{k} about {chr(97 + (n + k) % 26)} */\n"
                           f"SELECT col_{chr(97 + k)} FROM table_{chr(97 + n % 26)}\n" for k in range(5))
        prompt = ("/* Some SQL examples are provided based on similar problems: */\n" + examples
                  + "/* Given the following database schema: */\n" + _schema("db" + chr(97 + n // 10), 4)
                  + f"\n/* Answer the following: what is row {chr(97 + n % 26)} */\nSELECT ")
        labels.append(miner.observe_messages(pp.user(prompt)).template)
    assert len({id(miner.resolve(t)) for t in labels[10:]}) == 1
    assert len(miner.named) == 1


def test_one_off_prompts_stay_bounded_and_name_no_stage():
    miner = TemplateMiner(MinerConfig(max_new=64, max_stages=8))
    def word(n: int) -> str:  # distinct letters (digits are masked: they would not make prompts distinct)
        return "".join(chr(97 + (n // 26 ** k) % 26) for k in range(3))
    stages = [miner.observe(f"Tell me about {word(n)} and {word(n * 7919)}").stage for n in range(10_000)]
    assert len(miner.templates_) <= 64 + 8
    assert len(miner.named) <= 8
    assert sum(s is None for s in stages) >= 9_900


def test_odd_input_is_no_template():
    miner = TemplateMiner(track_merges=True)
    for text in ("", "   \n\n", "\x00\x01\x02" * 10_000, "x" * 2_000_000):
        assert miner.observe(text).stage is None
    assert miner.observe_messages(None).stage is None
    assert miner.observe_messages([{"role": "user", "content": [{"type": "image_url"}]}]).stage is None


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/traces beside the checkout")
@pytest.mark.parametrize("pipeline", ["din-sql", "dail-sql", "rsl-sql", "chess"])
def test_public_pipelines_filled_with_spider_and_bird(pipeline):
    calls = pp.TEXT2SQL[pipeline](SHARED, 120)
    miner = TemplateMiner(track_merges=True)
    labels = discovered(calls, miner)
    truth = {c.truth for c in calls}
    assert adjusted_rand([c.truth for c in calls], labels) >= 0.95
    assert len(miner.named) <= len(truth) + 1


def test_names_survive_a_restart():
    calls = chess_calls(6)
    first = TemplateMiner()
    names = {c.truth: first.observe_messages(c.messages).stage for c in calls[: 3 * len(pp._CHESS)]}
    changed, renamed = first.take_changes()
    assert {t.name for t in changed} == set(names.values()) and not renamed
    assert first.take_changes() == ([], [])  # taken once
    again = TemplateMiner()
    again.restore([(t.name, t.fixed_lines(), t.calls) for t in changed])
    # a new question's calls, each the first its template sees in this miner: named at once, as before
    assert [again.observe_messages(c.messages).stage for c in calls[-len(pp._CHESS):]] == \
        [names[c.truth] for c in calls[-len(pp._CHESS):]]


def reference_lines(text: str, max_bytes: int) -> list[str]:
    """csrc/template_lines.h, written plainly: whole UTF-8 characters of the first max_bytes,
    split at \\n or \\r, blank lines dropped, each run of ASCII digits one '0'."""
    data = text.encode()[:max_bytes].decode("utf-8", "ignore")
    lines = data.replace("\r", "\n").split("\n")
    return [re.sub(r"[0-9]+", "0", line) for line in lines if line.strip(" \t\f\v")]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab 7\t\n\r\x0b€é09") | st.characters(exclude_categories=("Cs",)),
               max_size=300),
       st.integers(0, 400))
def test_native_lines_match_the_reference(text, max_bytes):
    # (no lone surrogates: they have no UTF-8; Signature.of replaces them before the native side
    # reads a text, test_a_lone_surrogate_is_replaced_before_the_native_side_reads_it)
    lines = _core.masked_lines(text, max_bytes)
    assert lines == reference_lines(text, max_bytes)
    hashes = _core.line_hashes(text, max_bytes)
    assert len(hashes) == len(lines)
    assert _core.line_hashes("\n".join(lines), 1 << 40) == hashes  # masking twice changes nothing
    by_line = dict(zip(lines, hashes, strict=True))
    assert len(set(by_line.values())) == len(by_line)  # distinct lines, distinct hashes (here)


def test_a_lone_surrogate_is_replaced_before_the_native_side_reads_it():
    config = MinerConfig()
    signature = Signature.of("line one\n\ud800 line 22\n", config)
    assert signature.lines(config) == ["line one", "? line 0"] and len(signature.hashes) == 2


def test_adjusted_rand_index():
    a = ["x", "x", "y", "y", "z", "z"]
    assert adjusted_rand(a, [1, 1, 2, 2, 3, 3]) == 1.0  # the same partition under other names
    assert adjusted_rand(a, [0] * 6) == 0.0  # one cluster for all: no better than chance
    assert 0 < adjusted_rand(a, [1, 1, 2, 2, 2, 2]) < 1
