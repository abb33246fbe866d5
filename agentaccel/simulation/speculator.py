"""The one interface every simulated drafter has, driven as a server drives its proposer.

A request is begun with its prompt; after every step the server hands over its batch (vLLM's
input batch: a row of tokens per request and what the step gave each) and takes a draft per row
for the next step; the server tells how much of each draft it accepted, how long the step took,
and when a request left. The per-call replay (simulation/replay.py) drives a batch of one row;
the batched server (simulation/batch_replay.py) drives many; both drive every speculator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentaccel.engine.cost import TimedStep


class Chain:
    """A single-path draft: each token's parent is the token before it."""

    __slots__ = ("token_ids", "match_len")
    score = 0.0  # a batch drafter keeps its drafts' predicted acceptance to itself

    def __init__(self, token_ids: Sequence[int], match_len: int = 0) -> None:
        self.token_ids, self.match_len = token_ids, match_len

    @property
    def parents(self) -> range:
        return range(-1, len(self.token_ids) - 1)

    def __len__(self) -> int:
        return len(self.token_ids)


EMPTY = Chain(())  # no draft (shared: nobody mutates a draft)


class _First:
    """A draft's first `n` tokens (a tree's nodes come after their parents: still a tree)."""

    __slots__ = ("token_ids", "parents", "match_len", "score")

    def __init__(self, draft, n: int) -> None:
        self.token_ids, self.parents = list(draft.token_ids)[:n], list(draft.parents)[:n]
        self.match_len = draft.match_len
        self.score = float(sum(list(getattr(draft, "probs", ()))[:n]))  # the kept nodes' acceptance, as predicted

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Batch:
    """A step's batch as the server hands it to its proposer: a row per request."""

    keys: list[str | None]  # each row's request (None: an empty row)
    rows: np.ndarray  # int32 [rows, width]: each request's tokens so far, prompt first
    num_tokens: np.ndarray  # int32 [rows]: how many of each row's tokens are valid
    sampled: list[Sequence[int] | None]  # the tokens the step gave each row; None: its prefill is still running
    done: list[bool]  # the request's last tokens are in: it leaves, no draft is wanted
    max_len: int  # no draft makes a request's tokens outgrow this (the server's max_model_len)

    @classmethod
    def empty(cls, size: int, width: int) -> Batch:
        """`size` empty rows of `width` tokens (drafts may fill a row)."""
        return cls([None] * size, np.zeros((size, width), dtype=np.int32), np.zeros(size, dtype=np.int32),
                   [None] * size, [False] * size, width)


class Speculator:
    """Interface: begin a request, draft for the batch after every step, hear what was accepted
    and what the step cost, end the request."""

    name: str
    # A ceiling, not a drafter: its drafts are cut to what the model accepts (the batched server
    # also gives them only to the requests the true step cost favours)
    oracle = False
    # A ceiling told whether each draft's first `known` tokens will be accepted (the batched server
    # allocates its `candidates` with that: speculators.KnownTokens); None: not one
    known: int | None = None
    overlapped = False  # async scheduling: the step's CPU work hides behind the GPU's (plain decoding only)

    def warm(self, output: np.ndarray, stage: str, tenant: str | None = None) -> None:
        """A finished call's output joins the history, as an imported trace does."""

    def begin(self, key: str, prompt: np.ndarray, stage: str, previous: str | None = None,
              tenant: str | None = None, max_total: int | None = None) -> None:
        """A request arrives. `previous`: the call of its session it continues (a server that does
        not know sessions ignores it); `max_total`: its prompt plus the most tokens it may generate."""

    def foresee(self, key: str, output: np.ndarray) -> None:
        """The call's recorded output, handed over before its first step: only an oracle reads it."""

    def step(self, batch: Batch) -> list:
        """Each row's new tokens taken in; a draft per row (`token_ids`, `parents`, `match_len`,
        `score`, its length by `len`) for the step to come."""
        return [EMPTY] * len(batch.keys)

    def accepted(self, key: str, draft, accepted: int) -> None:
        """How many of the draft's tokens the step accepted (an online policy learns from it)."""

    def observe(self, step: TimedStep) -> None:
        """The step that just ran and its time: a drafter that learns the step cost learns from it."""

    def drafter_ran(self, passes: int, seconds: float) -> None:
        """A model drafter's `passes` after the last step drafted, and their `seconds` (the hybrid's
        stage records weigh them against what its chains save)."""

    def end(self, key: str) -> None:
        """The request left the batch."""

    def tree_tokens(self) -> int:
        return 0


class PerRequest(Speculator):
    """A speculator that drafts for each request alone: a step advances every listed request by
    its new tokens and asks `propose` for its draft, cut to what fits in the request's row."""

    def step(self, batch: Batch) -> list:
        out = []
        for key, new, done, n in zip(batch.keys, batch.sampled, batch.done, batch.num_tokens.tolist(), strict=True):
            if key is None or new is None:
                out.append(EMPTY)
                continue
            if len(new):
                self.advance(key, new if isinstance(new, np.ndarray) else np.asarray(new, dtype=np.uint32))
            room = batch.max_len - n - 1  # the draft and the step's own token fit in the request's row
            if done or room <= 0:
                out.append(EMPTY)
                continue
            draft = self.propose(key)
            out.append(draft if len(draft) <= room else _First(draft, room))
        return out

    def advance(self, key: str, tokens: np.ndarray) -> None:
        """The request's new tokens."""

    def propose(self, key: str):
        return EMPTY
