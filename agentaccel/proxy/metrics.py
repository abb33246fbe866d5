"""Prometheus metrics, labelled by stage (and on a server with API keys by tenant as well, so that
each tenant's key reads its own series only: `render(tenant)`). One registry per app (tests run
several apps)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agentaccel.backends.base import SpecStats, scoped_stage, split_stage

if TYPE_CHECKING:
    from agentaccel.traces.recorder import Recorder

disable_created_metrics()  # the *_created series double the output and nothing here reads them

MAX_STAGES = 512  # distinct stage labels before the rest are counted as "other"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """`external_spec`, when given, supplies the per-stage speculation totals (a backend that
    drafts out of process, like vLLM), keyed by the engine's stage key (a tenant's trees carry
    its scope); otherwise they are summed from each call's SpecStats. `tenants`: the server has
    API keys, and every stage series has a `tenant` label too."""

    def __init__(self, external_spec: Callable[[], dict[str, dict[str, int]]] | None = None,
                 recorder: Recorder | None = None,
                 policies: Callable[[], dict[str, dict[str, float]]] | None = None,
                 drafter: Callable[[], dict] | None = None,
                 counters: Callable[[], list[tuple[str, str, str, dict[str, float]]]] | None = None,
                 tenants: bool = False) -> None:
        self.registry = r = CollectorRegistry()
        self.tenants = tenants
        who = ["stage", "tenant"] if tenants else ["stage"]
        self.requests = Counter("agentaccel_requests", "Requests served", [*who, "endpoint", "status"], registry=r)
        self.latency = Histogram("agentaccel_request_latency_seconds", "Request latency", [*who, "endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("agentaccel_time_to_first_token_seconds", "Time to the first streamed token",
                              who, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("agentaccel_prompt_tokens", "Prompt tokens", who, registry=r)
        self.output_tokens = Counter("agentaccel_output_tokens", "Output tokens", who, registry=r)
        self.history_blocks = Counter(
            "agentaccel_history_blocks", "Blocks of a conversation a model cannot be sent as they came (server tools' "
            "calls and results, documents, reasoning, citations): shown as text, or dropped",
            [*who, "endpoint", "type", "as"], registry=r)
        self._spec_totals: dict[str, dict[str, int]] = {}
        self._labels: set[str] = set()
        r.register(_SpecCollector(external_spec or (lambda: self._spec_totals), self.stage_labels, who))
        if policies is not None:
            r.register(_PolicyCollector(policies))
        if drafter is not None:
            r.register(_DrafterCollector(drafter))
        if counters is not None:
            r.register(_BackendCounters(counters, self.stage_labels, who))
        if recorder is not None:  # counted by the recorder and its writer process
            for family, name, doc, value in (
                    (CounterMetricFamily, "agentaccel_recorder_errors",
                     "Calls answered but not stored (a failed transaction, a writer that died holding them)",
                     lambda: recorder.failed),
                    (CounterMetricFamily, "agentaccel_recorder_store_replaced",
                     "Times the trace store file was deleted or replaced while serving", lambda: recorder.reopened),
                    (CounterMetricFamily, "agentaccel_recorder_restarts",
                     "Times the recorder's writer process died and was started again", lambda: recorder.restarts),
                    (GaugeMetricFamily, "agentaccel_recorder_up",
                     "1 while the recorder's writer process runs (0: calls are not recorded)",
                     lambda: int(recorder.alive))):
                r.register(_ValueCollector(family, name, doc, value))

    def watch_discovery(self, read: Callable[[], dict[str, float]]) -> None:
        """Stage discovery's counts (proxy/discovery.py), read at scrape time."""
        for family, name, doc, key in (
                (GaugeMetricFamily, "agentaccel_discovered_stages",
                 "Prompt templates established as stages (tmpl:...)", "stages"),
                (GaugeMetricFamily, "agentaccel_template_candidates",
                 "Prompts seen once, kept while they wait for a second call of their template", "pending"),
                (CounterMetricFamily, "agentaccel_discovered_requests",
                 "Untagged requests given a discovered stage", "found"),
                (CounterMetricFamily, "agentaccel_undiscovered_requests",
                 "Untagged requests that matched no established template (sent to 'default')", "unmatched"),
                (CounterMetricFamily, "agentaccel_template_overflow",
                 "Requests of templates past the cap on discovered stages (sent to 'default')", "overflow"),
                (CounterMetricFamily, "agentaccel_template_save_errors",
                 "Times discovered templates could not be saved to the trace store", "save_errors")):
            self.registry.register(_ValueCollector(family, name, doc, lambda key=key: read()[key]))

    def watch_retention(self, read: Callable[[], dict[str, float]]) -> None:
        """The trace store's retention (traces/pruner.py), read at scrape time."""
        for family, name, doc, key in (
                (GaugeMetricFamily, "agentaccel_store_bytes",
                 "The trace store's size as its budget counts it, at the last check", "bytes"),
                (CounterMetricFamily, "agentaccel_store_pruned_calls",
                 "Calls this server pruned from the trace store (past --keep-days or --store-budget)", "calls"),
                (CounterMetricFamily, "agentaccel_store_prune_errors",
                 "Checks of the trace store's retention that failed (the server serves on)", "errors")):
            self.registry.register(_ValueCollector(family, name, doc, lambda key=key: read()[key]))

    def label(self, stage: str) -> str:
        """Stage names come from clients: past MAX_STAGES distinct ones, the rest share the label
        "other" (each label value is a time series in Prometheus; a client must not be able to
        create them without bound)."""
        if stage in self._labels or len(self._labels) < MAX_STAGES:
            self._labels.add(stage)
            return stage
        return "other"

    def blocks_not_sent(self, stage: str, tenant: str | None, endpoint: str, counts: dict) -> None:
        """A request's blocks that were rendered as text or dropped: {(type, "text" | "dropped"): n}."""
        for (kind, how), n in counts.items():
            self.history_blocks.labels(*self.who(stage, tenant), endpoint, kind, how).inc(n)

    def failed(self, endpoint: str, status: int, tenant: str | None = None) -> None:
        """A request refused before its stage was known (bad key, bad body)."""
        self.requests.labels(*self.who("-", tenant), endpoint, str(status)).inc()

    def who(self, stage: str, tenant: str | None) -> tuple[str, ...]:
        """The stage labels of a call (its stage capped by `label`, and its tenant on a keyed server)."""
        stage = self.label(stage)
        return (stage, tenant or "") if self.tenants else (stage,)

    def stage_labels(self, key: str) -> tuple[str, ...] | None:
        """The labels of an engine stage key's series; None for a tenant's trees on a server without
        keys (its /metrics is open to anyone: another server's tenants are not shown there)."""
        stage, scope = split_stage(key)
        if not self.tenants:
            return None if scope is not None else (stage,)
        return (stage, scope or "")

    def observe(self, stage: str, endpoint: str, status: int, seconds: float,
                prompt_tokens: int = 0, output_tokens: int = 0, spec: SpecStats | None = None,
                tenant: str | None = None) -> None:
        who = self.who(stage, tenant)
        self.requests.labels(*who, endpoint, str(status)).inc()
        self.latency.labels(*who, endpoint).observe(seconds)
        if prompt_tokens:
            self.prompt_tokens.labels(*who).inc(prompt_tokens)
        if output_tokens:
            self.output_tokens.labels(*who).inc(output_tokens)
        if spec is not None:
            key = scoped_key(who)
            totals = self._spec_totals.setdefault(key, {"steps": 0, "drafted": 0, "accepted": 0,
                                                        "saved_seconds": 0.0})
            for name, value in spec.as_dict().items():
                totals[name] += value

    def render(self, tenant: str | None = None) -> bytes:
        """Every series, or (`tenant`) only that tenant's: a tenant's key must not read which stages
        (template names come from prompts) or how much other tenants ran."""
        return generate_latest(self.registry if tenant is None else _OneTenant(self.registry, tenant))


def scoped_key(who: tuple[str, ...]) -> str:
    """The engine's stage key for a call's labels (the stage, with its tenant's scope when it has one)."""
    return scoped_stage(who[0], who[1]) if len(who) > 1 and who[1] else who[0]


class _OneTenant:
    """A registry's samples with the label tenant=<tenant> (what generate_latest reads)."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry, self.tenant = registry, tenant

    def collect(self):
        for family in self.registry.collect():
            samples = [s for s in family.samples if s.labels.get("tenant") == self.tenant]
            if samples:
                mine = copy.copy(family)
                mine.samples = samples
                yield mine


class _SpecCollector:
    """Speculation metrics per stage, computed at scrape time from running totals."""

    def __init__(self, source: Callable[[], dict[str, dict[str, int]]],
                 labels_of: Callable[[str], tuple[str, ...] | None], names: list[str]) -> None:
        self.source, self.labels_of, self.names = source, labels_of, names

    def describe(self):
        return []  # names are only known at collect time; nothing else registers them

    def collect(self):
        rows = [(labels, t) for key, t in sorted(self.source().items())
                if (labels := self.labels_of(key)) is not None]
        names = self.names
        steps = CounterMetricFamily("agentaccel_spec_steps", "Verification steps (forward passes that checked a "
                                    "draft, or could have)", labels=names)
        drafted = CounterMetricFamily("agentaccel_draft_tokens", "Draft tokens proposed from the trees",
                                      labels=names)
        accepted = CounterMetricFamily("agentaccel_accepted_tokens", "Draft tokens from the trees accepted",
                                       labels=names)
        rate = GaugeMetricFamily("agentaccel_acceptance_rate", "Accepted / drafted tokens of the trees' drafts",
                                 labels=names)
        model_drafted = CounterMetricFamily("agentaccel_model_draft_tokens", "The hybrid: draft tokens sent from "
                                            "the model drafter's chains, in place of the trees'", labels=names)
        model_accepted = CounterMetricFamily("agentaccel_model_accepted_tokens", "The hybrid: the model drafter's "
                                             "draft tokens accepted", labels=names)
        mean = GaugeMetricFamily("agentaccel_mean_accepted_length", "Tokens produced per verification step "
                                 "(accepted drafts, the trees' and the model's, + the bonus token)", labels=names)
        saved = CounterMetricFamily("agentaccel_speculation_saved_seconds", "What plain decoding would have taken "
                                    "the stage's requests more, priced by the server's step cost: the plain steps "
                                    "their accepted tokens spared, less what drafting added to their steps",
                                    labels=names)
        hybrid = any(t.get("model_drafted") for _, t in rows)  # the model's series only where a model drafts
        for labels, t in rows:
            steps.add_metric(labels, t.get("steps", 0))
            drafted.add_metric(labels, t.get("drafted", 0))
            accepted.add_metric(labels, t.get("accepted", 0))
            if hybrid:
                model_drafted.add_metric(labels, t.get("model_drafted", 0))
                model_accepted.add_metric(labels, t.get("model_accepted", 0))
            if t.get("drafted"):
                rate.add_metric(labels, t["accepted"] / t["drafted"])
            if t.get("steps"):
                mean.add_metric(labels, (t["accepted"] + t.get("model_accepted", 0) + t["steps"]) / t["steps"])
            saved.add_metric(labels, t.get("saved_seconds", 0.0))
        yield from (steps, drafted, accepted, rate, mean, saved)
        if hybrid:
            yield from (model_drafted, model_accepted)


class _PolicyCollector:
    """Each stage's drafting policy in force ("*": the default), read at scrape time."""

    GAUGES = (("min_score", "agentaccel_policy_min_score", "Tau: drafts whose expected accepted tokens fall below "
               "it are not made"),
              ("confidence", "agentaccel_policy_confidence", "How far the drafter's probabilities are trusted "
               "(tuned, times the online factor)"),
              ("cost", "agentaccel_policy_cost", "Verification cost per draft token the growth pays for"),
              ("max_tokens", "agentaccel_policy_max_tokens", "Longest draft"),
              ("trust", "agentaccel_policy_online_factor", "Online calibration: accepted / predicted draft tokens, "
               "as applied to the confidence"),
              ("mean_draft", "agentaccel_policy_mean_draft_tokens", "Mean draft tokens per drafted step"))

    def __init__(self, source: Callable[[], dict[str, dict[str, float]]]) -> None:
        self.source = source

    def describe(self):
        return []

    def collect(self):
        families = [(key, GaugeMetricFamily(name, doc, labels=["stage"])) for key, name, doc in self.GAUGES]
        for stage, values in list(self.source().items())[:MAX_STAGES]:
            for key, family in families:
                family.add_metric([stage], float(values.get(key, 0.0)))
        yield from (f for _, f in families)


class _DrafterCollector:
    """A batch drafter's own time (the vLLM plugin's) and the step cost a backend drafts under."""

    def __init__(self, source: Callable[[], dict]) -> None:
        self.source = source

    def describe(self):
        return []

    def collect(self):
        state = self.source()
        if not state:
            return
        if "proposer_seconds" in state:
            yield CounterMetricFamily("agentaccel_proposer_seconds", "Time the proposer spent drafting, all steps",
                                      value=state["proposer_seconds"])
            yield CounterMetricFamily("agentaccel_proposer_steps", "Steps the proposer drafted for",
                                      value=state.get("steps", 0))
        if "step_seconds" in state:
            yield GaugeMetricFamily("agentaccel_step_cost_timed_steps", "Timed steps the step cost was learned from",
                                    value=state.get("timed_steps", 0))
            cost = GaugeMetricFamily("agentaccel_step_cost_seconds", "Learned time of a step computing this many "
                                     "tokens (without context)", labels=["tokens"])
            for tokens, seconds in state["step_seconds"].items():
                cost.add_metric([tokens], seconds)
            yield cost


class _BackendCounters:
    """A backend's own labelled counters (`Backend.counters`), read at scrape time."""

    def __init__(self, source: Callable[[], list[tuple[str, str, str, dict[str, float]]]],
                 labels_of: Callable[[str], tuple[str, ...] | None], names: list[str]) -> None:
        self.source, self.labels_of, self.names = source, labels_of, names

    def describe(self):
        return []

    def collect(self):
        for name, doc, label, values in self.source():
            if label != "stage":
                family = CounterMetricFamily(name, doc, labels=[label])
                for value, count in values.items():
                    family.add_metric([value], count)
                yield family
                continue
            rows = [(labels, count) for key, count in values.items() if (labels := self.labels_of(key)) is not None]
            family = CounterMetricFamily(name, doc, labels=self.names)
            for labels, count in rows:
                family.add_metric(labels, count)
            yield family


class _ValueCollector:
    """One unlabelled value read at scrape time."""

    def __init__(self, family, name: str, doc: str, read: Callable[[], float]) -> None:
        self.family, self.name, self.doc, self.read = family, name, doc, read

    def describe(self):
        return [self.family(self.name, self.doc)]

    def collect(self):
        yield self.family(self.name, self.doc, value=self.read())
