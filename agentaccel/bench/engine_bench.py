"""`agentaccel bench engine`: update, speculate, memory, save and load of the native engine on
real traces.

Every 50th document is held out; the index is built from the rest in a fresh process (so the
RSS delta is the index alone), saved, and loaded back here. Each held-out document is then
replayed as a request whose prompt is the document before it: at each step the engine drafts,
the longest draft path that matches the real next tokens is accepted plus one bonus token, and
those tokens are appended. Only the `speculate` calls are timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.bench.corpus import TokenCorpus
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.verification import accepted_length
from agentaccel.simulation.speculators import PAPER_LINEAR, PAPER_TREE

HOLD_OUT_EVERY = 50

CONFIGS: dict[str, SpecConfig] = {
    "paper-linear": PAPER_LINEAR,
    "paper-tree": PAPER_TREE,
    "agentaccel-linear": SpecConfig(mode="mixture", tree=False),
    "agentaccel-tree": SpecConfig(mode="mixture", tree=True),
}


@dataclass
class BuildResult:
    tokens: int
    documents: int
    build_seconds: float
    index_bytes: int
    rss_delta_bytes: int
    save_seconds: float
    file_bytes: int


def _build_child(corpus_npz: str, max_depth: int, save_path: str, copies: int = 1) -> None:
    """Runs in a fresh interpreter: builds the index and reports what it cost. With `copies` > 1
    the documents are indexed that many times, each copy with token ids shifted past the last
    copy's (an index of the same shape, `copies` times larger: the load-time scale test)."""
    import psutil

    data = np.load(corpus_npz)
    tokens, offsets = data["tokens"].astype(np.uint32), data["offsets"]
    keep = [i for i in range(len(offsets) - 1) if i % HOLD_OUT_EVERY != 0]
    vocab = int(tokens.max()) + 1
    proc = psutil.Process()
    eng = SuffixEngine(max_depth=max_depth)
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    for k in range(copies):
        shifted = tokens + np.uint32(k * vocab) if k else tokens
        for i in keep:
            eng.add_document(shifted[offsets[i] : offsets[i + 1]])
    eng.compact()  # as seeding from the trace store does
    build = time.perf_counter() - t0
    rss1 = proc.memory_info().rss
    t0 = time.perf_counter()
    eng.save(save_path)
    save = time.perf_counter() - t0
    stats = eng.stats()
    print(json.dumps(BuildResult(stats["tokens"], stats["documents"], build, stats["bytes"], rss1 - rss0, save,
                                 os.path.getsize(save_path)).__dict__))


def build_in_fresh_process(corpus: TokenCorpus, max_depth: int, workdir: Path, copies: int = 1,
                           name: str = "engine.aai") -> BuildResult:
    npz = workdir / "corpus.npz"
    if not npz.exists():
        np.savez(npz, tokens=corpus.tokens, offsets=corpus.offsets)
    index = workdir / name
    out = subprocess.run(
        [sys.executable, "-c",
         f"from agentaccel.bench.engine_bench import _build_child; _build_child({str(npz)!r}, {max_depth}, "
         f"{str(index)!r}, {copies})"],
        check=True, capture_output=True, text=True,
    )
    return BuildResult(**json.loads(out.stdout.strip().splitlines()[-1]))


def load_in_fresh_process(index: Path) -> float:
    """Seconds `SuffixEngine.load` takes in a new interpreter (the file is in the page cache)."""
    out = subprocess.run(
        [sys.executable, "-c",
         "import time; from agentaccel.engine import SuffixEngine; t = time.perf_counter(); "
         f"SuffixEngine.load({str(index)!r}); print(time.perf_counter() - t)"],
        check=True, capture_output=True, text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def replay_requests(eng: SuffixEngine, corpus: TokenCorpus, config: SpecConfig, max_requests: int,
                    max_output: int, prompt_tokens: int, max_tokens: int) -> dict:
    held = [i for i in range(1, len(corpus)) if i % HOLD_OUT_EVERY == 0][:max_requests]
    times: list[int] = []
    accepted = 0
    produced = 0
    for n, i in enumerate(held):
        prompt = corpus.doc(i - 1)[-prompt_tokens:]
        output = corpus.doc(i)[:max_output]
        rid = f"b{n}"
        eng.start_request(rid, prompt)
        pos = 0
        while pos < len(output):
            t0 = time.perf_counter_ns()
            draft = eng.speculate(rid, max_tokens, config)
            times.append(time.perf_counter_ns() - t0)
            acc = accepted_length(draft.token_ids, draft.parents, output[pos:])
            step = min(acc + 1, len(output) - pos)
            eng.extend(rid, output[pos : pos + step])
            accepted += step
            pos += step
        produced += len(output)
        eng.finish_request(rid, keep_output=False)
    arr = np.array(times) / 1000.0
    return {
        "steps": len(times),
        "spec_us_mean": float(arr.mean()),
        "spec_us_p50": float(np.percentile(arr, 50)),
        "spec_us_p99": float(np.percentile(arr, 99)),
        "mat": produced / max(len(times), 1),
    }


def run(corpus: TokenCorpus, max_depth: int = 64, max_requests: int = 200, max_output: int = 256,
        prompt_tokens: int = 2048, max_tokens: int = 32, load_scale: int = 0, progress=None) -> dict:
    """`load_scale` > 1 also builds an index `load_scale` times the corpus and times its load."""
    with tempfile.TemporaryDirectory(prefix="agentaccel-bench-") as tmp:
        workdir = Path(tmp)
        if progress:
            progress("building the index in a fresh process")
        build = build_in_fresh_process(corpus, max_depth, workdir)
        if progress:
            progress("loading it back")
        t0 = time.perf_counter()
        eng = SuffixEngine.load(workdir / "engine.aai")
        load_seconds = time.perf_counter() - t0
        results = {}
        for name, config in CONFIGS.items():
            if progress:
                progress(f"replaying held-out requests: {name}")
            results[name] = replay_requests(eng, corpus, config, max_requests, max_output, prompt_tokens,
                                            max_tokens)
        del eng
        scaled = None
        if load_scale > 1:
            if progress:
                progress(f"building a {load_scale}x index for the load-time test")
            big = build_in_fresh_process(corpus, max_depth, workdir, copies=load_scale, name="scaled.aai")
            (workdir / "engine.aai").unlink()
            if progress:
                progress("loading the scaled index in fresh processes")
            loads = [load_in_fresh_process(workdir / "scaled.aai") for _ in range(3)]
            scaled = {"copies": load_scale, "tokens": big.tokens, "file_bytes": big.file_bytes,
                      "bytes_per_token": big.index_bytes / big.tokens, "save_seconds": big.save_seconds,
                      "load_seconds": min(loads), "load_seconds_all": loads}
    return {
        "tokens": build.tokens,
        "documents": build.documents,
        "max_depth": max_depth,
        "update_us_per_token": build.build_seconds * 1e6 / build.tokens,
        "index_bytes_per_token": build.index_bytes / build.tokens,
        "rss_bytes_per_token": build.rss_delta_bytes / build.tokens,
        "save_seconds": build.save_seconds,
        "load_seconds": load_seconds,
        "file_bytes": build.file_bytes,
        "speculate": results,
        "scaled_load": scaled,
    }
