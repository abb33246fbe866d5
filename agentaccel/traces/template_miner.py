"""Prompt templates found as calls arrive: the stage of an untagged call.

A stage is a prompt template: text that stays the same across calls, with slots that change (the
schema, the question, the workspace, the date). A call is read as lines of its *template text* (the
system message and the first user message, digits masked) and goes to the template whose fixed
lines it contains.

Calls of a pipeline form a grid: every stage meets every database and every question, so the text
two calls share says as readily "same database" as "same stage". What breaks the symmetry:
- a line that the fixed text of several templates holds (a schema every stage shows) tells no
  template from another: a template is recognised by its *own* fixed lines, the first
  `window_chars` of them in prompt order, anchored by the first;
- templates mostly open with their instructions: a slot right after a shared opening (examples
  chosen per question, as DAIL-SQL's) shows up as templates of one opening that never see a
  second call, and past `slot_after` of them they merge into one;
- a call that opens with known slot content (RSL-SQL's answer selection starts with its examples)
  joins the established template whose fixed text it shows, or merges with one-call templates
  that waited `stale_after` calls and share fixed text with it.
The first call of a template goes to `default`; the template is a stage from its second call on,
so a flood of one-off prompts leaves at most `max_new` provisional templates behind and no stage
names. Names are bounded (`max_stages`) and held by standing, not by arrival: a template's
standing is its calls, each weighed down by half every `half_life` calls since. When all names are
taken, a template that earned one takes the place of the weakest name if it stands higher, and the
weaker one is retired (its row leaves the trace store); else it goes to `default` (counted). So
prompts that each come twice cannot hold the names for good: a stage that keeps recurring stands
far above them, and one that stopped recurring gives its place back. A template restored from the
store stands at one call until it recurs. Names are unique in a fleet: `reserve` tells the miner
the names other servers' templates hold in the shared store, and a template takes one of those
only if it is the same template (half of the smaller one's fixed lines in common).
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from dataclasses import dataclass

from agentaccel._native import load_core
from agentaccel.text.messages import message_text

_core = load_core()

PREFIX = "tmpl:"
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class MinerConfig:
    max_chars: int = 8192  # bytes of template text read per call: templates open with their fixed text
    max_lines: int = 512  # fixed lines kept per template
    window_chars: int = 2048  # distinctive fixed text a call must show, read from the template's start
    join: float = 0.5  # share of that text a call must contain
    slot_after: int = 3  # one-call templates of one opening that make its next lines a slot
    stale_after: int = 48  # calls a one-call template waits before it may be a slot-first template's call
    stale_scan: int = 16  # one-call templates looked at for that, oldest first (bounds a one-off flood's cost)
    min_core_chars: int = 64  # fixed text those must share
    cover: float = 0.9  # share of an established template's fixed text that makes a slot-first call its call
    max_stages: int = 128  # established templates (stage names)
    half_life: int = 10_000  # calls over which a template's standing (its recent calls) halves
    max_new: int = 512  # one-call templates kept while they wait for a second call
    max_shared: int = 200_000  # lines remembered as slot content
    refine_every: int = 16  # past 64 calls a template learns (slot content, fixed lines) from every n-th call only


def template_text(messages, limit: int | None = None) -> str:
    """The system message(s) and the first user message: where a pipeline puts a stage's
    instructions (later messages are the conversation, not the template); the first `limit`
    characters of it when given."""
    parts, size = [], 0
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            parts.append(message_text(m))
            size += len(parts[-1]) + 1
            if m.get("role") not in ("system", "developer") or (limit is not None and size >= limit):
                break
    text = "\n".join(parts)
    return text if limit is None else text[:limit]


@dataclass
class Signature:
    hashes: list[int]  # one per non-blank line, digits masked (csrc/template_lines.h)
    text: str  # read again, as lines, only when the call makes a template

    @classmethod
    def of(cls, text: str, config: MinerConfig) -> Signature:
        # No more characters than bytes read: the native side reads the text as UTF-8, and a long
        # prompt beyond ASCII would be encoded whole.
        text = text[: config.max_chars]
        try:
            return cls(_core.line_hashes(text, config.max_chars), text)
        except (UnicodeEncodeError, TypeError):  # lone surrogates: no UTF-8 of their own (the binding refuses the str)
            cleaned = text.encode("utf-8", "replace").decode("utf-8")
            if cleaned == text:
                raise
            return cls(_core.line_hashes(cleaned, config.max_chars), cleaned)

    def lines(self, config: MinerConfig) -> list[str]:
        return _core.masked_lines(self.text, config.max_chars)


@dataclass
class Template:
    name: str | None  # None until its second call
    order: list[int]  # its first call's lines (hashes) in order; the fixed ones are in `fixed`
    texts: dict[int, str]  # text of the fixed lines
    fixed: set[int]
    calls: int = 1
    created: int = 0  # the miner's call counter when it was made
    window: list[tuple[int, int]] | None = None  # (line, chars) it is matched on, as of the anchor index
    window_chars: int = 1  # their sum
    standing: float = 1.0  # its calls, each halved per `half_life` calls since (as of `touched`)
    touched: int = 0  # the miner's call counter at its last call

    def fixed_lines(self) -> list[str]:
        return [self.texts[h] for h in self.order if h in self.fixed]


@dataclass
class Match:
    stage: str | None  # None: not a stage (yet): the caller's default
    template: Template | None


class TemplateMiner:
    """Online template discovery. Not thread-safe: one caller (the proxy's event loop, or a CLI)."""

    def __init__(self, config: MinerConfig | None = None, track_merges: bool = False) -> None:
        self.config = config or MinerConfig()
        self.track_merges = track_merges  # keep `merged_into` (benchmarks, tests: which call went where)
        self.templates_: list[Template] = []
        self.named: dict[str, Template] = {}
        self.new: OrderedDict[int, Template] = OrderedDict()  # one-call templates, oldest first
        self.holders: Counter[int] = Counter()  # line -> templates whose fixed set holds it
        self.shared: set[int] = set()  # lines two templates ever held at once: slot content (a schema)
        self.variable: set[int] = set()  # of those, lines a call of a template showed outside its fixed text
        self.version = 0  # bumped when `holders` changes (windows and the index are cached against it)
        self._index: dict[int, list[Template]] = {}  # anchor line -> templates anchored there
        self._index_version = -1
        self._named_cache: set[int] = set()
        self._named_version = -1
        self.seen = 0
        self.overflow = 0
        self.merged_into: dict[int, Template] = {}  # id of a merged template -> the one it became
        self.changed: set[str] = set()  # stages whose template changed since `take_changes`
        self.renamed: list[tuple[str, str]] = []  # (old, new): stages merged into another since then
        self.retired: list[str] = []  # names given up to a template that stands higher, since then
        self.reserved: dict[str, frozenset[int]] = {}  # names other servers' templates hold (their lines)

    # --- matching ----------------------------------------------------------------------------
    def observe_messages(self, messages) -> Match:
        return self.observe(template_text(messages, self.config.max_chars))

    def observe(self, text: str) -> Match:
        sig = Signature.of(text, self.config)
        self.seen += 1
        if not sig.hashes:
            return Match(None, None)
        present = set(sig.hashes)
        best = self._best(present) or self._merge_slot(present, sig.hashes)
        if best is None:
            return self._create(sig)
        return self._join(best, present)

    def _best(self, present: set[int]) -> Template | None:
        """The template whose window this call shows most of (at least `join`), among those whose
        anchor (first own fixed line) it holds: usually one or two, so a call costs a set lookup
        per line and a scan of a window or two, however many templates there are."""
        anchors = self._anchor_index()
        best, best_score = None, self.config.join
        for anchor in present.intersection(anchors):
            for t in anchors[anchor]:
                score = sum(w for h, w in t.window if h in present) / t.window_chars
                if score > best_score or (best is not None and score == best_score and t.calls > best.calls):
                    best, best_score = t, score
        return best

    def _anchor_index(self) -> dict[int, list[Template]]:
        if self._index_version != self.version:
            index: dict[int, list[Template]] = {}
            for t in self.templates_:
                t.window = self._window(t)
                t.window_chars = sum(w for _, w in t.window) or 1
                if t.window:
                    index.setdefault(t.window[0][0], []).append(t)
            self._index, self._index_version = index, self.version
        return self._index

    def _window(self, t: Template) -> list[tuple[int, int]]:
        """The first `window_chars` of the template's own fixed text, in prompt order: lines never
        seen as slot content, else lines no other template holds, else all its fixed lines."""
        for own in (lambda h: h not in self.shared, lambda h: self.holders[h] == 1, lambda h: True):
            limit, got, window = self.config.window_chars, 0, []
            for h in t.order:
                if h in t.fixed and own(h):
                    window.append((h, len(t.texts[h]) + 1))
                    got += window[-1][1]
                    if got >= limit:
                        break
            if window:
                return window
        return []

    # --- learning ----------------------------------------------------------------------------
    def _join(self, t: Template, present: set[int]) -> Match:
        t.calls += 1
        t.standing, t.touched = self.standing(t) + 1.0, self.seen
        # A mature template learns from a sample of its calls: what they tell (slot content, a
        # fixed line that turned out to vary) repeats, and the bookkeeping is most of a call's cost.
        if t.calls <= 64 or t.calls % self.config.refine_every == 0:
            self._slot_content(present - t.fixed, variable=True)
            gone = t.fixed - present
            if gone:
                self._drop(t, gone)
        if t.name is None and not self._establish(t):
            return Match(None, t)
        return Match(t.name, t)

    def _slot_content(self, lines: set[int], variable: bool = False) -> None:
        new = lines - self.shared
        if new:
            self.shared |= new
            if any(h in self.holders for h in new):  # else no template's window changes
                self.version += 1
            if len(self.shared) > self.config.max_shared:
                self.shared.clear()  # rare (a flood of one-off prompts); templates re-learn it
                self.variable.clear()
        if variable:
            self.variable |= lines

    def _drop(self, t: Template, lines: set[int]) -> None:
        self._slot_content(lines, variable=True)
        t.fixed -= lines
        self.holders.subtract(lines)
        for h in lines:
            if self.holders[h] <= 0:
                del self.holders[h]
            t.texts.pop(h, None)
        t.order = [h for h in t.order if h in t.fixed]
        self.version += 1
        if t.name:
            self.changed.add(t.name)

    def standing(self, t: Template) -> float:
        """The template's calls, each weighed down by half per `half_life` calls since it came."""
        return t.standing * 0.5 ** ((self.seen - t.touched) / self.config.half_life)

    def _establish(self, t: Template) -> bool:
        self.new.pop(id(t), None)
        if len(self.named) >= self.config.max_stages:
            weakest = min(self.named.values(), key=self.standing)
            if self.standing(weakest) >= self.standing(t):
                self.overflow += 1
                self.new[id(t)] = t  # stays a candidate; evicted like any other one-call template
                return False
            self._retire(weakest)
        t.name = self._name(t)
        self.named[t.name] = t
        self.changed.add(t.name)
        self.version += 1
        return True

    def _retire(self, t: Template) -> None:
        """Takes a name from a template that stopped recurring: the template is forgotten (if it
        comes back, it is found again and earns a name again)."""
        del self.named[t.name]
        self.changed.discard(t.name)
        self.retired.append(t.name)
        t.name = None
        self._remove(t)

    def _create(self, sig: Signature) -> Match:
        order, texts = [], {}
        for h, line in zip(sig.hashes, sig.lines(self.config), strict=True):
            if h not in texts and len(order) < self.config.max_lines:
                order.append(h)
                texts[h] = line
        t = Template(None, order, texts, set(order), created=self.seen, touched=self.seen)
        self._add(t)
        self.new[id(t)] = t
        while len(self.new) > self.config.max_new:
            self._remove(self.new.popitem(last=False)[1])
        return Match(None, t)

    def _add(self, t: Template) -> None:
        self.templates_.append(t)
        self.holders.update(t.fixed)
        if len(self.templates_) > 1:
            self._slot_content({h for h in t.fixed if self.holders[h] > 1})
        self.version += 1

    def _remove(self, t: Template) -> None:
        self.templates_.remove(t)
        self.holders.subtract(t.fixed)
        for h in t.fixed:
            if self.holders[h] <= 0:
                del self.holders[h]
        self.version += 1

    def _merge_slot(self, present: set[int], hashes: list[int]) -> Template | None:
        """A call no template matches may show that some one-call templates are one template
        whose slot comes early; with `slot_after` of them they merge into the oldest, whose fixed
        text becomes what they all share:
        - templates that open with this call's first line (examples chosen per question right
          after the opening, as DAIL-SQL's);
        - templates that opened with a slot (RSL-SQL's answer selection starts with the examples)
          and share with this call fixed text no established template holds. Only those that
          waited `stale_after` calls for a second one: a pipeline's stages all recur within that,
          and before they do, its first run's prompts share the schema and question just as well."""
        first = hashes[0]
        if first not in self.variable:
            siblings = [t for t in self.templates_ if t.order and t.order[0] == first]
        else:  # the call opens with what other calls showed as slot content
            covering = self._covering(present)
            if covering is not None:
                return covering
            siblings = self._stale_siblings(present)
        if len(siblings) < self.config.slot_after:
            return None
        home = min(siblings, key=lambda t: (t.name is None, t.created))
        core = set(home.fixed) & present
        for t in siblings:
            core &= t.fixed
        for t in siblings:
            if t is home:
                continue
            self._remove(t)
            self.new.pop(id(t), None)
            if self.track_merges:
                self.merged_into[id(t)] = home
            home.calls += t.calls
            home.standing = self.standing(home) + self.standing(t)
            home.touched = self.seen
            if t.name:
                del self.named[t.name]
                self.changed.discard(t.name)
                if home.name:
                    self.renamed.append((t.name, home.name))
        if home.fixed - core:
            self._drop(home, home.fixed - core)
        return home

    # --- what the trace store keeps ----------------------------------------------------------
    def restore(self, saved: list[tuple[str, list[str], int]]) -> None:
        """Established templates as a store kept them: (stage, fixed lines in order, calls)."""
        for name, lines, calls in saved:
            if name in self.named or len(self.named) >= self.config.max_stages:
                continue
            hashes = _core.line_hashes("\n".join(lines), 1 << 62)
            if len(hashes) != len(lines):  # not lines this miner wrote (blank, or with line breaks)
                continue
            texts = dict(zip(hashes, lines, strict=True))
            # it stands at one call until it recurs: names kept from a flood give their place back
            t = Template(name, list(texts), texts, set(texts), calls=max(int(calls), 2), created=self.seen,
                         touched=self.seen)
            self._add(t)
            self.named[name] = t
            self.reserved.pop(name, None)

    def take_changes(self) -> tuple[list[Template], list[tuple[str, str]]]:
        """Established templates that changed (new, narrowed, merged into) and the stages merged
        away since the last call; the caller saves them (and `take_retired`)."""
        changed = [self.named[n] for n in sorted(self.changed) if n in self.named]
        renamed, self.changed, self.renamed = self.renamed, set(), []
        return changed, renamed

    def take_retired(self) -> list[str]:
        """Names given up since the last call that no template holds again: the caller removes them
        from the store."""
        retired, self.retired = [n for n in dict.fromkeys(self.retired) if n not in self.named], []
        return retired

    # --- a fleet's names ---------------------------------------------------------------------
    def reserve(self, stored: dict[str, list[str]]) -> list[str]:
        """The templates a shared store holds (stage -> fixed lines), as read after a save: names
        this miner does not hold are reserved for those templates; a name this miner holds for
        another template than the store's is given up (the store's row was there first) and the
        template named anew. Returns the names given up."""
        self.reserved = {}
        lost = []
        for name, lines in stored.items():
            hashes = line_set(lines)
            mine = self.named.get(name)
            if mine is None:
                self.reserved[name] = hashes
            elif not same_template(mine.fixed, hashes):
                self.reserved[name] = hashes
                del self.named[name]
                self.changed.discard(name)
                mine.name = self._name(mine)
                self.named[mine.name] = mine
                self.changed.add(mine.name)
                lost.append(name)
        if lost:
            self.version += 1
        return lost

    def _covering(self, present: set[int]) -> Template | None:
        """The established template whose whole fixed text (but what is slot content elsewhere)
        this call shows, all but `1 - cover` of it: a slot-first call of it whose anchor fell
        into the slot."""
        best, best_score = None, self.config.cover
        for t in self.named.values():
            score = self._shows(t, present)
            if score > best_score:
                best, best_score = t, score
        return best

    def _shows(self, t: Template, present: set[int]) -> float:
        """The share of the template's fixed text the call holds, not counting lines that other
        calls showed as slot content (a schema tells no template from another); 0 for a template
        with under `min_core_chars` of it."""
        own = t.fixed - self.variable
        total = sum(len(t.texts[h]) for h in own)
        if total < self.config.min_core_chars:
            return 0.0
        return sum(len(t.texts[h]) for h in own & present) / total

    def _stale_siblings(self, present: set[int]) -> list[Template]:
        unheld = present - self._named_lines()
        if not unheld:
            return []
        siblings, core = [], unheld
        for scanned, t in enumerate(self.new.values()):  # oldest first
            if scanned >= self.config.stale_scan or self.seen - t.created < self.config.stale_after:
                break
            common = core & t.fixed
            if sum(len(t.texts[h]) for h in common) >= self.config.min_core_chars:
                siblings.append(t)
                core = common
        return siblings

    def _named_lines(self) -> set[int]:
        """Lines the fixed text of an established template holds (cached against `version`)."""
        if self._named_version != self.version:
            self._named_cache = set().union(*(t.fixed for t in self.named.values()))
            self._named_version = self.version
        return self._named_cache

    def resolve(self, t: Template | None) -> Template | None:
        """The template a call's template became after merges."""
        while t is not None and id(t) in self.merged_into:
            t = self.merged_into[id(t)]
        return t

    # --- names -------------------------------------------------------------------------------
    def _name(self, t: Template) -> str:
        lines = t.fixed_lines()
        own = [t.texts[h] for h in t.order if h in t.fixed and h not in self.shared]
        for source in (lines[:1], own[:1], own[:3]):
            base = slug(" ".join(source))
            if base and self._free(PREFIX + base, t):
                return PREFIX + base
        base = slug(" ".join(lines[:1])) or "template"
        n = 2
        while not self._free(f"{PREFIX}{base}-{n}", t):
            n += 1
        return f"{PREFIX}{base}-{n}"

    def _free(self, name: str, t: Template) -> bool:
        """Whether `t` may be called `name`: no template here holds it, and in the fleet only the
        same template does."""
        if name in self.named:
            return False
        other = self.reserved.get(name)
        return other is None or same_template(t.fixed, other)


def line_set(lines: list[str]) -> frozenset[int]:
    """The hashes of fixed lines as a store keeps them (what `same_template` compares)."""
    return frozenset(_core.line_hashes("\n".join(lines), 1 << 62))


def same_template(a: set[int] | frozenset[int], b: set[int] | frozenset[int]) -> bool:
    """Two servers' templates are one when half of the smaller one's fixed lines are the other's
    too (what a call needs to join a template)."""
    return bool(a) and bool(b) and len(a & b) >= 0.5 * min(len(a), len(b))


def slug(text: str, words: int = 6, limit: int = 48) -> str:
    """Readable, label-safe words of a template's opening (`identify-the-tables-...`)."""
    out = "-".join(_WORD.findall(text.lower())[:words])
    return out[:limit].rstrip("-")
