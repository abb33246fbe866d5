"""Real-trace token corpora for benchmarks (read from ../shared/traces, never copied into the repo).

Tokenized corpora are cached under the agentaccel cache folder, keyed by the source files'
sizes and mtimes and by the tokenizer's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.assets import cache_dir
from agentaccel.text.tokenization import TextTokenizer

GET_TRACES = ("this benchmark reads real recorded agent traces, which a fresh clone does not have: point --traces or "
              "$AGENTACCEL_TRACES at a folder laid out as docs/TRACES.md (\"Benchmark data\") describes, or measure "
              "on your own calls with `agentaccel bench replay`, which reads the trace store that `agentaccel serve` "
              "records into")


class TracesMissing(FileNotFoundError):
    """A benchmark's real-trace inputs are not there; the message says what is missing and how to get it."""


def default_traces_dir() -> Path:
    """$AGENTACCEL_TRACES, else the first `shared/traces` beside the working folder or the repo
    (where a development checkout keeps them)."""
    env = os.environ.get("AGENTACCEL_TRACES")
    if env:
        return Path(env)
    for start in (Path.cwd(), Path(__file__).resolve()):
        for folder in (start, *start.parents):
            candidate = folder.parent / "shared" / "traces"
            if candidate.is_dir():
                return candidate
    raise TracesMissing(f"no traces folder: {GET_TRACES}")


def require(traces: Path, missing: str | None) -> None:
    """Raises TracesMissing naming what `traces` lacks (None: nothing)."""
    if missing is not None:
        raise TracesMissing(f"{missing}: {GET_TRACES}")


@dataclass
class TokenCorpus:
    """Documents as one flat token array plus offsets (document i = tokens[offsets[i]:offsets[i+1]])."""

    tokens: np.ndarray
    offsets: np.ndarray
    kinds: list[str]  # source kind of each document ("swe-agent", "chat")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def swe_agent_texts(traces: Path) -> Iterator[tuple[str, str]]:
    """Every message of every SWE-agent trajectory: what the model read and wrote."""
    for path in sorted(traces.glob("swe-agent/*/trajs/*.traj")):
        for msg in json.loads(path.read_text())["history"]:
            if isinstance(msg.get("content"), str) and msg["content"]:
                yield "swe-agent", msg["content"]


def chat_message_texts(traces: Path) -> Iterator[tuple[str, str]]:
    """Trajectories stored as OpenAI-style message lists (SWE-smith, SWE-Gym OpenHands, Nebius)."""
    files = ["swe-agent/swe-smith.json", "openhands/swe-gym_openhands_sampled_trajectories.json",
             "swe-agent/nebius_SWE-agent-trajectories.json"]
    for name in files:
        path = traces / name
        if not path.exists():
            continue
        for record in json.loads(path.read_text()):
            for msg in record.get("messages") or record.get("trajectory") or []:
                text = msg.get("content") or msg.get("text")
                if isinstance(text, list):  # content parts
                    text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
                if isinstance(text, str) and text:
                    yield "swe-agent", text


def openhands_log_texts(traces: Path) -> Iterator[tuple[str, str]]:
    """OpenHands mock prompt/response logs of real runs."""
    for path in sorted(traces.glob("openhands/mock_logs/**/*.log")):
        text = path.read_text(errors="replace")
        if text:
            yield "openhands", text


def chat_texts(traces: Path) -> Iterator[tuple[str, str]]:
    """AlpacaEval model outputs of every model."""
    for path in sorted(traces.glob("chat/alpaca_eval/*/model_outputs.json")):
        for row in json.loads(path.read_text()):
            if row.get("output"):
                yield "chat", row["output"]


def engine_sources(traces: Path) -> list[Path]:
    """The files `engine_corpus` reads."""
    return (sorted(traces.glob("swe-agent/*/trajs/*.traj")) + sorted(traces.glob("swe-agent/*.json"))
            + sorted(traces.glob("openhands/*.json")) + sorted(traces.glob("openhands/mock_logs/**/*.log"))
            + sorted(traces.glob("chat/alpaca_eval/*/*.json")))


def engine_corpus(traces: Path, tokenizer: TextTokenizer) -> TokenCorpus:
    sources = engine_sources(traces)
    require(traces, None if sources else f"{traces}: no SWE-agent, OpenHands or AlpacaEval files")
    key = hashlib.sha256(
        (tokenizer.fingerprint + "".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sources)).encode()
    ).hexdigest()[:16]
    cached = cache_dir() / "corpora" / f"engine-{key}.npz"
    if cached.exists():
        data = np.load(cached)
        return TokenCorpus(data["tokens"], data["offsets"], data["kinds"].tolist())
    kinds, texts = [], []
    for kind, text in [*swe_agent_texts(traces), *chat_message_texts(traces), *openhands_log_texts(traces),
                       *chat_texts(traces)]:
        kinds.append(kind)
        texts.append(text)
    ids = tokenizer.encode_batch(texts)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    tokens = np.fromiter((t for doc in ids for t in doc), dtype=np.uint32, count=int(offsets[-1]))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens, offsets=offsets, kinds=np.array(kinds))
    tmp.replace(cached)
    return TokenCorpus(tokens, offsets, kinds)
