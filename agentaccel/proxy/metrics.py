"""Prometheus metrics, all labelled by stage. One registry per app (tests run several apps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agentaccel.backends.base import SpecStats

if TYPE_CHECKING:
    from agentaccel.traces.recorder import Recorder

disable_created_metrics()  # the *_created series double the output and nothing here reads them

MAX_STAGES = 512  # distinct stage labels before the rest are counted as "other"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """`external_spec`, when given, supplies the per-stage speculation totals (a backend that
    drafts out of process, like vLLM); otherwise they are summed from each call's SpecStats."""

    def __init__(self, external_spec: Callable[[], dict[str, dict[str, int]]] | None = None,
                 recorder: Recorder | None = None,
                 policies: Callable[[], dict[str, dict[str, float]]] | None = None,
                 drafter: Callable[[], dict] | None = None,
                 counters: Callable[[], list[tuple[str, str, str, dict[str, float]]]] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("agentaccel_requests", "Requests served", ["stage", "endpoint", "status"], registry=r)
        self.latency = Histogram("agentaccel_request_latency_seconds", "Request latency", ["stage", "endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("agentaccel_time_to_first_token_seconds", "Time to the first streamed token",
                              ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("agentaccel_prompt_tokens", "Prompt tokens", ["stage"], registry=r)
        self.output_tokens = Counter("agentaccel_output_tokens", "Output tokens", ["stage"], registry=r)
        self._spec_totals: dict[str, dict[str, int]] = {}
        self._labels: set[str] = set()
        r.register(_SpecCollector(external_spec or (lambda: self._spec_totals)))
        if policies is not None:
            r.register(_PolicyCollector(policies))
        if drafter is not None:
            r.register(_DrafterCollector(drafter))
        if counters is not None:
            r.register(_BackendCounters(counters))
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

    def label(self, stage: str) -> str:
        """Stage names come from clients: past MAX_STAGES distinct ones, the rest share the label
        "other" (each label value is a time series in Prometheus; a client must not be able to
        create them without bound)."""
        if stage in self._labels or len(self._labels) < MAX_STAGES:
            self._labels.add(stage)
            return stage
        return "other"

    def observe(self, stage: str, endpoint: str, status: int, seconds: float,
                prompt_tokens: int = 0, output_tokens: int = 0, spec: SpecStats | None = None) -> None:
        stage = self.label(stage)
        self.requests.labels(stage, endpoint, str(status)).inc()
        self.latency.labels(stage, endpoint).observe(seconds)
        if prompt_tokens:
            self.prompt_tokens.labels(stage).inc(prompt_tokens)
        if output_tokens:
            self.output_tokens.labels(stage).inc(output_tokens)
        if spec is not None:
            totals = self._spec_totals.setdefault(stage, {"steps": 0, "drafted": 0, "accepted": 0})
            for key, value in spec.as_dict().items():
                totals[key] += value

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecCollector:
    """Speculation metrics per stage, computed at scrape time from running totals."""

    def __init__(self, source: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.source = source

    def describe(self):
        return []  # names are only known at collect time; nothing else registers them

    def collect(self):
        steps = CounterMetricFamily("agentaccel_spec_steps", "Verification steps (forward passes that checked a "
                                    "draft, or could have)", labels=["stage"])
        drafted = CounterMetricFamily("agentaccel_draft_tokens", "Draft tokens proposed", labels=["stage"])
        accepted = CounterMetricFamily("agentaccel_accepted_tokens", "Draft tokens accepted", labels=["stage"])
        rate = GaugeMetricFamily("agentaccel_acceptance_rate", "Accepted / drafted tokens", labels=["stage"])
        mean = GaugeMetricFamily("agentaccel_mean_accepted_length", "Tokens produced per verification step "
                                 "(accepted drafts + the bonus token)", labels=["stage"])
        for stage, t in sorted(self.source().items()):
            steps.add_metric([stage], t.get("steps", 0))
            drafted.add_metric([stage], t.get("drafted", 0))
            accepted.add_metric([stage], t.get("accepted", 0))
            if t.get("drafted"):
                rate.add_metric([stage], t["accepted"] / t["drafted"])
            if t.get("steps"):
                mean.add_metric([stage], (t["accepted"] + t["steps"]) / t["steps"])
        yield from (steps, drafted, accepted, rate, mean)


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
    """A batch drafter's own time and the step cost it drafts under (the vLLM plugin's)."""

    def __init__(self, source: Callable[[], dict]) -> None:
        self.source = source

    def describe(self):
        return []

    def collect(self):
        state = self.source()
        if not state:
            return
        yield CounterMetricFamily("agentaccel_proposer_seconds", "Time the proposer spent drafting, all steps",
                                  value=state.get("proposer_seconds", 0.0))
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

    def __init__(self, source: Callable[[], list[tuple[str, str, str, dict[str, float]]]]) -> None:
        self.source = source

    def describe(self):
        return []

    def collect(self):
        for name, doc, label, values in self.source():
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, count in values.items():
                family.add_metric([value], count)
            yield family


class _ValueCollector:
    """One unlabelled value read at scrape time."""

    def __init__(self, family, name: str, doc: str, read: Callable[[], float]) -> None:
        self.family, self.name, self.doc, self.read = family, name, doc, read

    def describe(self):
        return [self.family(self.name, self.doc)]

    def collect(self):
        yield self.family(self.name, self.doc, value=self.read())
