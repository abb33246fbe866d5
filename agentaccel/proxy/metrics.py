"""Prometheus metrics, all labelled by stage. One registry per app (tests run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from agentaccel.backends.base import SpecStats

disable_created_metrics()  # the *_created series double the output and nothing here reads them

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("agentaccel_requests", "Requests served", ["stage", "endpoint", "status"], registry=r)
        self.latency = Histogram("agentaccel_request_latency_seconds", "Request latency", ["stage", "endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("agentaccel_time_to_first_token_seconds", "Time to the first streamed token",
                              ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("agentaccel_prompt_tokens", "Prompt tokens", ["stage"], registry=r)
        self.output_tokens = Counter("agentaccel_output_tokens", "Output tokens", ["stage"], registry=r)
        self.steps = Counter("agentaccel_spec_steps", "Verification steps (forward passes after prefill)",
                             ["stage"], registry=r)
        self.drafted = Counter("agentaccel_draft_tokens", "Draft tokens proposed", ["stage"], registry=r)
        self.accepted = Counter("agentaccel_accepted_tokens", "Draft tokens accepted", ["stage"], registry=r)
        self.acceptance = Gauge("agentaccel_acceptance_rate", "Accepted / drafted tokens", ["stage"], registry=r)
        self.mean_accepted = Gauge("agentaccel_mean_accepted_length",
                                   "Tokens produced per verification step, the bonus token included", ["stage"],
                                   registry=r)
        self.recorder_dropped = Counter("agentaccel_recorder_errors", "Calls the recorder failed to store",
                                        registry=r)
        self._totals: dict[str, list[int]] = {}  # stage -> [calls, steps, drafted, accepted, output tokens]

    def observe(self, stage: str, endpoint: str, status: int, seconds: float,
                prompt_tokens: int = 0, output_tokens: int = 0, spec: SpecStats | None = None) -> None:
        self.requests.labels(stage, endpoint, str(status)).inc()
        self.latency.labels(stage, endpoint).observe(seconds)
        if prompt_tokens:
            self.prompt_tokens.labels(stage).inc(prompt_tokens)
        if output_tokens:
            self.output_tokens.labels(stage).inc(output_tokens)
        if spec is not None:
            self.observe_spec(stage, spec, output_tokens)

    def observe_spec(self, stage: str, spec: SpecStats, output_tokens: int) -> None:
        self.steps.labels(stage).inc(spec.steps)
        self.drafted.labels(stage).inc(spec.drafted)
        self.accepted.labels(stage).inc(spec.accepted)
        t = self._totals.setdefault(stage, [0, 0, 0, 0, 0])
        for i, v in enumerate((1, spec.steps, spec.drafted, spec.accepted, output_tokens)):
            t[i] += v
        if t[2]:
            self.acceptance.labels(stage).set(t[3] / t[2])
        # the prefill's forward pass yields a token too (as GenerationResult.mean_accepted counts)
        self.mean_accepted.labels(stage).set(t[4] / (t[0] + t[1]))

    def render(self) -> bytes:
        return generate_latest(self.registry)
