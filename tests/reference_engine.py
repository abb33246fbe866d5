"""Pure-Python reference of SuffixDecoding (Oliaro et al., NeurIPS 2025): the test oracle.

Written for clarity, not speed: every tree is an uncompressed suffix trie of depth `max_depth`
whose node counts are occurrence counts, rebuilt from the documents whenever they change. The
native engine's paper mode must return exactly the drafts this module returns.

The algorithm, per tree (request tree, stage tree, or the union of all stage trees, whose counts
add up):
  for p = 1 .. min(P, max_depth, len(context)):
      walk the tree with the last p tokens; stop when they do not occur
      MAX_SPEC = min(max_tokens, floor(alpha * p))
      grow greedily: D(child) = D(parent) * COUNT(child) / sum of COUNT over its siblings;
          repeatedly add the candidate with the highest D (ties: lower parent index, then lower
          token id) until MAX_SPEC nodes or D < min_prob; nodes deeper than max_depth - p do not
          exist. Linear drafts follow only the best child (highest COUNT, then lowest token).
      SCORE = sum of D; keep the best p (ties: the longer pattern)
Across trees the best SCORE wins (ties: request, then stage, then union). If it is below
min_score (tau) the draft is empty.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field


class TrieNode:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, TrieNode] = {}


def build_trie(documents: list[list[int]], max_depth: int) -> TrieNode:
    root = TrieNode()
    for doc in documents:
        for i in range(len(doc)):
            node = root
            for tok in doc[i : i + max_depth]:
                node = node.children.setdefault(tok, TrieNode())
                node.count += 1
    return root


def walk(root: TrieNode, pattern: list[int]) -> TrieNode | None:
    node = root
    for tok in pattern:
        node = node.children.get(tok)
        if node is None:
            return None
    return node


@dataclass
class RefDraft:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""

    def add(self, token: int, parent: int, d: float) -> int:
        """Appends a node; returns its index."""
        self.token_ids.append(token)
        self.parents.append(parent)
        self.probs.append(d)
        self.score += d
        return len(self.token_ids) - 1


def _merged_children(nodes: list[TrieNode]) -> dict[int, tuple[int, list[TrieNode]]]:
    merged: dict[int, tuple[int, list[TrieNode]]] = {}
    for node in nodes:
        for tok, child in node.children.items():
            count, group = merged.get(tok, (0, []))
            merged[tok] = (count + child.count, group + [child])
    return merged


def grow(roots: list[TrieNode], budget: int, room: int, min_prob: float, tree: bool) -> RefDraft:
    draft = RefDraft()
    if tree:
        heap: list = []

        def push_children(nodes: list[TrieNode], parent_index: int, parent_d: float, depth: int) -> None:
            if depth >= room:
                return
            kids = _merged_children(nodes)
            total = sum(c for c, _ in kids.values())
            for tok, (count, group) in kids.items():
                heapq.heappush(heap, (-(parent_d * (count / total)), parent_index, tok, depth + 1, group))

        push_children(roots, -1, 1.0, 0)
        while heap and len(draft.token_ids) < budget:
            neg_d, parent_index, tok, depth, group = heapq.heappop(heap)
            d = -neg_d
            if d < min_prob:
                break
            push_children(group, draft.add(tok, parent_index, d), d, depth)
        return draft

    nodes, d, depth, parent = roots, 1.0, 0, -1
    while len(draft.token_ids) < budget and depth < room:
        kids = _merged_children(nodes)
        if not kids:
            break
        total = sum(c for c, _ in kids.values())
        tok, (count, group) = min(kids.items(), key=lambda kv: (-kv[1][0], kv[0]))
        d = d * (count / total)
        if d < min_prob:
            break
        nodes, depth, parent = group, depth + 1, draft.add(tok, parent, d)
    return draft


def speculate_tree(
    tries: list[TrieNode],
    context: list[int],
    *,
    max_depth: int,
    max_tokens: int,
    alpha: float,
    max_pattern: int,
    min_prob: float,
    tree: bool,
) -> RefDraft | None:
    """The best draft of one tree over all pattern lengths, or None if nothing matches."""
    longest = min(max_pattern or max_depth, max_depth, len(context))
    best = None
    for p in range(1, longest + 1):
        nodes = [n for n in (walk(t, context[-p:]) for t in tries) if n is not None]
        if not nodes:
            break
        budget = min(max_tokens, math.floor(alpha * p))
        draft = grow(nodes, budget, max_depth - p, min_prob, tree)
        draft.match_len = p
        if best is None or draft.score >= best.score:
            best = draft
    return best


class ReferenceEngine:
    """Mirror of SuffixEngine's paper mode over plain Python data."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.docs: dict[int, tuple[str, list[int]]] = {}
        self._tries: dict[str, TrieNode] | None = None

    def add_document(self, doc_id: int, tokens: list[int], stage: str) -> None:
        self.docs[doc_id] = (stage, list(tokens))
        self._tries = None

    def remove_document(self, doc_id: int) -> None:
        del self.docs[doc_id]
        self._tries = None

    def stage_tries(self) -> dict[str, TrieNode]:
        if self._tries is None:
            by_stage: dict[str, list[list[int]]] = {}
            for doc_id in sorted(self.docs):
                stage, tokens = self.docs[doc_id]
                by_stage.setdefault(stage, []).append(tokens)
            self._tries = {s: build_trie(d, self.max_depth) for s, d in by_stage.items()}
        return self._tries

    def speculate(
        self,
        context: list[int],
        stage: str,
        *,
        max_tokens: int = 32,
        alpha: float = 1.0,
        max_pattern: int = 0,
        min_prob: float = 0.1,
        min_score: float = 0.0,
        tree: bool = True,
        trees: tuple[str, ...] = ("request", "stage"),
    ) -> RefDraft:
        tries = self.stage_tries()
        candidates = {
            "request": [build_trie([context], self.max_depth)],
            "stage": [tries[stage]] if stage in tries else [],
            "union": list(tries.values()),
        }
        best = None
        for name in ("request", "stage", "union"):
            if name not in trees:
                continue
            draft = speculate_tree(
                candidates[name], context, max_depth=self.max_depth, max_tokens=max_tokens, alpha=alpha,
                max_pattern=max_pattern, min_prob=min_prob, tree=tree,
            )
            if draft is not None and (best is None or draft.score > best.score):
                draft.source = name
                best = draft
        if best is None or not best.token_ids:
            return RefDraft(score=0.0 if best is None else best.score)
        if best.score < min_score:
            return RefDraft(score=best.score)
        return best
