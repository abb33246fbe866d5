"""vLLM's suffix decoding on Model Runner V2 (`suffix-gpu`), simulated: the speculator that runs
entirely on the GPU and so keeps async scheduling (vllm/v1/worker/gpu/spec_decode/suffix/ on vLLM's
main branch at 05084858, in no release up to 0.33), with the adaptive verification that trims its
drafts (spec_decode/adaptive_verification.py). Its rules,
as that source states them (this is a model of them in numpy, not its kernels):

* the request's own history: the earlier occurrence whose preceding tokens match the longest
  suffix of the request's tokens (up to `max_depth`; ties: the later one), its continuation the draft;
* a corpus of finished requests (each the last 3 prompt tokens and the response), a ring of
  `corpus_tokens` tokens: a document that does not fit before the ring's end wraps to its start,
  overwriting the oldest; documents end in a separator. A hash index keyed on the 2 and the 4
  tokens before each position keeps, per bucket, `slots` entries: slot `document number % slots`
  holds that document's newest occurrence (a newer document of the same slot replaces it). A
  lookup takes the 2 x `slots` entries of the request's last 2 and last 4 tokens, reads each
  against the corpus as it now is (a hash collision or an overwritten document costs only the
  slot), extends it to its full match, and votes: for each match length L, the candidates
  matching at least L tokens vote token by token (most frequent next token, ties to the newest
  candidate), the chain scoring the sum of its running per-token frequencies; the best score
  wins (ties: the longer L);
* the longer match of the two wins (ties: the request's own); the draft has exactly `k` tokens,
  the slots past the match filled with the last token (verified, and rejected, as any other);
* adaptive verification: every draft slot has a confidence, the Laplace-smoothed acceptance
  observed for (source, match-length bucket 1..6 each, 7-10, 11-20, 21+, position); fillers 0.
  The step keeps the draft budget that maximises (requests sampling + the sum of the best slots'
  survival, the running product of confidences) over the step's cost, and gives it to the slots
  of highest survival across the batch. The verdicts fold back into the counts (each accepted
  position and the first rejected one are observed); the counts are halved every `half_life` steps.

Priced with async scheduling's overlap (`overlapped`) as `none-async` is: the host's part of each
step hides behind the GPU's; `suffix-gpu-sync` is the same drafter without it. The drafter's
own GPU time is not added (no drafter's time is, in the simulators). The budget here prices a step
with the server's own step cost, over the decoding rows (vLLM prices it from curves it measures
at start-up, and knows the step's prefill chunks, which a proposer here does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentaccel.engine.cost import Server
from agentaccel.simulation.speculator import EMPTY, Batch, Chain, Speculator

LEN_BUCKETS = 9  # match lengths 1..6 one bucket each, then 7-10, 11-20, 21+
SOURCES = 2  # 0: the request's own history; 1: the corpus
_MUL = np.uint64(0x9E3779B97F4A7C15)  # an odd 64-bit multiplier (Fibonacci hashing)


@dataclass(frozen=True)
class SuffixGpuConfig:
    """The speculative config's knobs as the V2 suffix speculator reads them, and its constants."""

    k: int = 32  # num_speculative_tokens: every draft has exactly this many slots
    max_depth: int = 64  # suffix_decoding_max_tree_depth: the longest match counted
    corpus_tokens: int = 1 << 20  # suffix_decoding_corpus_tokens (0: no corpus)
    slots: int = 8  # corpus entries per hash bucket
    prompt_context: int = 3  # prompt tokens kept ahead of each response (longest key - 1)
    half_life: int = 1024  # steps between halvings of the acceptance counts
    adaptive: bool = True  # enable_adaptive_verification: trim drafts by their confidences

    @property
    def buckets(self) -> int:
        """Hash buckets of each index: a power of two, a quarter of the corpus (16 at least)."""
        return 1 << max(4, (max(16, self.corpus_tokens // 4) - 1).bit_length())


def len_bucket(match_len: int) -> int:
    """The match-length bucket of adaptive verification's counts."""
    m = max(match_len, 1)
    return m - 1 if m <= 6 else 6 if m <= 10 else 7 if m <= 20 else 8


def local_match(seq: np.ndarray, depth: int) -> tuple[int, int]:
    """(match length, start of the continuation) of the earlier occurrence in `seq` whose
    preceding tokens match the longest suffix of `seq` (at most `depth`; ties: the latest);
    (0, 0) when the last token never occurred before."""
    n = len(seq)
    if n < 2 or depth < 1:
        return 0, 0
    alive = np.flatnonzero(seq[: n - 1] == seq[n - 1]) + 1  # continuations after an earlier last token
    if not len(alive):
        return 0, 0
    best = (1, int(alive[-1]))
    for t in range(1, min(depth, n)):
        alive = alive[alive - 1 - t >= 0]
        alive = alive[seq[alive - 1 - t] == seq[n - 1 - t]]
        if not len(alive):
            break
        best = (t + 1, int(alive[-1]))
    return best


def _hash_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of the `n` tokens before each position j >= n of `tokens` (the token just before
    first), as uint64: row j - n."""
    h = np.zeros(len(tokens) - n, dtype=np.uint64)
    for d in range(n):
        h = (h ^ tokens[n - 1 - d : len(tokens) - 1 - d].astype(np.uint64)) * _MUL
    return h


class Corpus:
    """The ring of finished documents and its two hash indexes (keys of 4 and of 2 tokens)."""

    KEYS = (4, 2)

    def __init__(self, config: SuffixGpuConfig) -> None:
        self.config = config
        self.capacity = config.corpus_tokens
        self.tokens = np.full(max(self.capacity, 1), -1, dtype=np.int64)
        self.shift = np.uint64(64 - (config.buckets.bit_length() - 1))
        # entries: document number << 32 | corpus position (-1: empty), [key, bucket, slot]
        self.table = np.full((2, config.buckets, config.slots), -1, dtype=np.int64)
        self.head = 0
        self.documents = 0

    def _bucket(self, h: np.ndarray) -> np.ndarray:
        return (h >> self.shift).astype(np.int64)

    def add(self, doc: np.ndarray) -> None:
        """A finished request's tokens (its last prompt tokens and its response) join the ring."""
        if self.capacity <= 0:
            return
        doc = np.asarray(doc, dtype=np.int64)[-(self.capacity - 1):] if self.capacity > 1 else doc[:0]
        n = len(doc)
        if self.head + n + 1 > self.capacity:  # no document straddles the ring's end
            self.head = 0
        self.tokens[self.head : self.head + n] = doc
        self.tokens[self.head + n] = -1
        slot = self.documents % self.config.slots
        positions = self.head + np.arange(n, dtype=np.int64)
        values = (np.int64(self.documents) << np.int64(32)) | positions
        for key, width in enumerate(self.KEYS):
            if n > width:
                buckets = self._bucket(_hash_keys(doc, width))
                # the document's newest occurrence of each bucket (its entries are the slot's newest)
                np.maximum.at(self.table[key, :, slot], buckets, values[width:])
        self.head += n + 1
        self.documents += 1

    def draft(self, seq: np.ndarray, k: int, depth: int) -> tuple[int, list[int]]:
        """(match length, chain of at most `k` tokens) voted from the corpus for a request whose
        tokens are `seq`; (0, []) when no candidate holds."""
        n = len(seq)
        if self.capacity <= 0 or n < 2:
            return 0, []
        cand, widths = [], []
        for key, width in enumerate(self.KEYS):
            if n < width:
                continue
            # the request's next position, keyed as the ingest keys a document's positions
            h = _hash_keys(np.append(seq[n - width :], 0), width)
            cand.append(self.table[key, int(self._bucket(h)[0])])
            widths.append(np.full(self.config.slots, width))
        vals = np.concatenate(cand)
        widths = np.concatenate(widths)
        live = vals >= 0
        if not live.any():
            return 0, []
        vals, widths = vals[live], widths[live]
        pos = vals & 0xFFFFFFFF
        # each candidate read against the corpus as it is now: its full match, up to `depth`
        reach = min(depth, n)
        back = pos[:, None] - 1 - np.arange(reach)[None, :]
        held = np.where(back >= 0, self.tokens[np.maximum(back, 0)], -1)
        tail = seq[n - 1 - np.arange(reach)].astype(np.int64)
        lengths = np.cumprod(held == tail[None, :], axis=1).sum(axis=1)
        ok = (lengths >= widths) & (self.tokens[pos] >= 0)
        if not ok.any():
            return 0, []
        vals, pos, lengths = vals[ok], pos[ok], lengths[ok]
        # both indexes often hold the same position: counted once (its first candidate that holds)
        _, first = np.unique(pos, return_index=True)
        first.sort()
        vals, pos, lengths = vals[first], pos[first], lengths[first]
        ahead = pos[:, None] + np.arange(k)[None, :]
        cont = np.where(ahead < self.capacity, self.tokens[np.minimum(ahead, self.capacity - 1)], -1)
        cont = np.where(np.cumsum(cont < 0, axis=1) == 0, cont, -1)  # cut at the document's end
        best_score, best_len, best_chain = -1.0, 0, []
        cont_l, vals_l, lengths_l = cont.tolist(), vals.tolist(), lengths.tolist()
        for length in dict.fromkeys(lengths_l):  # each distinct length once, in candidate order
            alive = [i for i, m in enumerate(lengths_l) if m >= length]
            score, chain = _vote(cont_l, vals_l, alive, k)
            if score > best_score or (score == best_score and best_len < length):
                best_score, best_len, best_chain = score, length, chain
        return int(best_len), best_chain


def _vote(cont: list[list[int]], vals: list[int], alive: list[int], k: int) -> tuple[float, list[int]]:
    """The chain the `alive` candidates (indexes into `cont`, their continuations, -1 past their
    document's end) vote for, token by token, and its score: the sum of the running products of
    each token's share of the candidates still agreeing. Plain Python: a handful of candidates."""
    score, running, chain = 0.0, 1.0, []
    for d in range(k):
        if len(alive) == 1:  # one candidate left: its continuation, each token's share 1
            rest = cont[alive[0]][d:]
            n = rest.index(-1) if -1 in rest else len(rest)
            for _ in range(n):  # summed as the vote sums it (a tie between lengths is exact)
                score += running
            return score, chain + rest[:n]
        first = cont[alive[0]][d]
        if first >= 0 and all(cont[i][d] == first for i in alive):  # unanimous
            score += running
            chain.append(first)
            continue
        counts: dict[int, int] = {}
        newest: dict[int, int] = {}
        for i in alive:
            t = cont[i][d]
            if t >= 0:
                counts[t] = counts.get(t, 0) + 1
                newest[t] = max(newest.get(t, -1), vals[i])
        if not counts:
            break
        top = max(counts.values())
        nxt = max((t for t, c in counts.items() if c == top), key=newest.__getitem__)  # ties: the newest
        running *= top / len(alive)
        score += running
        chain.append(nxt)
        alive = [i for i in alive if cont[i][d] == nxt]
    return score, chain


class SuffixGpu(Speculator):
    """vLLM's V2 suffix speculator with adaptive verification (module docstring). `cost`: the
    server whose step cost the verification budget weighs (None: every draft slot verified, as
    without adaptive verification); `overlapped`: async scheduling kept."""

    def __init__(self, name: str, config: SuffixGpuConfig, cost: Server | None = None,
                 overlapped: bool = True) -> None:
        self.name, self.config, self.server, self.overlapped = name, config, cost, overlapped
        self.corpus = Corpus(config)
        self.stats = np.zeros((SOURCES * LEN_BUCKETS, config.k, 2), dtype=np.int64)  # accepted, observed
        self.steps = 0
        self._prompt_len: dict[str, int] = {}
        self._row: dict[str, int] = {}
        self._last: dict[str, tuple[int, int, int]] = {}  # key -> (bucket, real tokens, slots verified)
        self._batch: Batch | None = None

    def warm(self, output, stage, tenant=None):
        self.corpus.add(np.asarray(output))

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        self._prompt_len[key] = len(prompt)

    def accepted(self, key, draft, accepted: int) -> None:
        bucket, valid, verified = self._last.pop(key, (-1, 0, 0))
        if bucket < 0:
            return
        # the accepted positions and the first rejected one are observed
        seen = min(accepted + 1, verified, valid, self.config.k)
        self.stats[bucket, :seen, 1] += 1
        self.stats[bucket, : min(accepted, seen), 0] += 1

    def step(self, batch: Batch) -> list:
        cfg = self.config
        self._batch = batch
        self.steps += 1
        if cfg.adaptive and self.steps % cfg.half_life == 0:
            self.stats >>= 1
        drafts: list = [EMPTY] * len(batch.keys)
        rows, tokens, conf, buckets, valid, matches = [], [], [], [], [], []
        for i, (key, new, done) in enumerate(zip(batch.keys, batch.sampled, batch.done, strict=True)):
            if key is None:
                continue
            self._row[key] = i
            if new is None or not len(new) or done:  # a draft only after a sampled token
                continue
            n = int(batch.num_tokens[i])
            if batch.max_len - n - 1 <= 0:
                continue
            seq = batch.rows[i, :n]
            match, chain, source = self.propose(seq)
            bucket = source * LEN_BUCKETS + len_bucket(match)
            slots = chain + [int(seq[-1])] * (cfg.k - len(chain))
            c = (self.stats[bucket, :, 0] + 1.0) / (self.stats[bucket, :, 1] + 2.0)
            c[len(chain):] = 0.0
            rows.append(i)
            tokens.append(slots)
            conf.append(c)
            buckets.append(bucket if chain else -1)
            valid.append(len(chain))
            matches.append(match if chain else 0)
        if not rows:
            return drafts
        keep = self.trim(batch, rows, np.asarray(conf)) if cfg.adaptive and self.server is not None \
            else [cfg.k] * len(rows)
        for i, slots, bucket, n_valid, match, kept in zip(rows, tokens, buckets, valid, matches, keep, strict=True):
            room = batch.max_len - int(batch.num_tokens[i]) - 1
            kept = min(int(kept), room)
            self._last[batch.keys[i]] = (bucket, n_valid, kept)
            if kept:
                drafts[i] = Chain(slots[:kept], match)
        return drafts

    def propose(self, seq: np.ndarray) -> tuple[int, list[int], int]:
        """(match length, real draft tokens, source: 0 the request, 1 the corpus) for a request
        whose tokens are `seq`: the longer match of the two (ties: the request's own)."""
        cfg = self.config
        l_len, l_pos = local_match(seq, cfg.max_depth)
        g_len, g_chain = self.corpus.draft(seq, cfg.k, cfg.max_depth)
        if g_len > l_len:
            return g_len, g_chain, 1
        return l_len, seq[l_pos : l_pos + cfg.k].tolist() if l_len else [], 0

    def trim(self, batch: Batch, rows: list[int], conf: np.ndarray) -> list[int]:
        """How many slots of each row's draft the step verifies: the budget of best rate under the
        step cost, spent on the slots of highest survival across the batch."""
        survival = np.cumprod(conf, axis=1)
        flat = survival.ravel()
        order = np.argsort(-flat, kind="stable")
        scores = flat[order]
        contexts = batch.num_tokens[rows].astype(float)
        sampling = len(rows)  # the rows that sample next step (a prefill's own rows are not drafted)
        slot_context = np.repeat(contexts, survival.shape[1])[order]
        b = np.arange(len(scores) + 1)
        context = float(contexts.sum())
        attention = context + np.concatenate(([0.0], np.cumsum(slot_context)))
        seconds = self.server.seconds(sampling + b, context, attention, float(sampling))
        gain = sampling + np.concatenate(([0.0], np.cumsum(scores)))
        budget = int(np.argmax(gain / np.asarray(seconds, dtype=float)))
        keep = np.zeros(len(rows), dtype=int)
        np.add.at(keep, order[:budget] // survival.shape[1], 1)
        return keep.tolist()

    def end(self, key):
        prompt_len = self._prompt_len.pop(key, 0)
        i = self._row.pop(key, None)
        self._last.pop(key, None)
        if i is None or self._batch is None or self._batch.keys[i] != key:
            return
        n = int(self._batch.num_tokens[i])
        self.corpus.add(self._batch.rows[i, max(prompt_len - self.config.prompt_context, 0) : n])

    def tree_tokens(self) -> int:
        return int(min(self.corpus.head, self.corpus.capacity))
