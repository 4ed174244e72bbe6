"""The planner's decisions as Prometheus series, on its own registry (served by
``splitserve planner --metrics-port``; Grafana and KEDA/HPA read the desired counts from it)."""

from __future__ import annotations

import typing

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.capacity import InstanceCapacity, Slo, Workload
from planner.decision import ROLES, Decision, Reason

# The series' names, for what reads them back (the gateway's status page, gateway/status.py).
DESIRED = "splitserve_planner_desired_instances"
NEEDED = "splitserve_planner_needed_instances"
INSTANCES = "splitserve_planner_instances"
CAPACITY = "splitserve_planner_capacity_requests_per_second"
PREDICTED_RATE = "splitserve_planner_predicted_request_rate"
OBSERVED_RATE = "splitserve_planner_observed_request_rate"
MEAN_TOKENS = "splitserve_planner_mean_tokens"
OBSERVED_P90 = "splitserve_planner_observed_p90_seconds"
SLO_SECONDS = "splitserve_planner_slo_seconds"
REASON = "splitserve_planner_reason"
DECISIONS = "splitserve_planner_decisions"
STATES = ("starting", "ready", "draining")
REASONS: tuple[Reason, ...] = typing.get_args(Reason)


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge(DESIRED, "Instances the planner wants per role", ["role"], registry=r)
        self.needed = Gauge(
            NEEDED,
            "Instances the predicted rate needs per role, before bounds, cooldowns and the budget",
            ["role"],
            registry=r,
        )
        self.instances = Gauge(
            INSTANCES,
            "The planner's instances per role and state (starting: not ready yet; ready: routed to; draining: "
            "finishing its streams before it stops)",
            ["role", "state"],
            registry=r,
        )
        self.capacity = Gauge(
            CAPACITY,
            "Requests a second one instance of the role sustains within the SLOs, for the predicted mix",
            ["role"],
            registry=r,
        )
        self.predicted_rate = Gauge(PREDICTED_RATE, "Requests a second the planner sizes for", registry=r)
        self.observed_rate = Gauge(OBSERVED_RATE, "Requests a second dispatched last interval", registry=r)
        self.mean_tokens = Gauge(MEAN_TOKENS, "Mean tokens a request the planner sizes for", ["kind"], registry=r)
        self.observed_p90 = Gauge(
            OBSERVED_P90,
            "Last interval's p90 from the gateways' histograms (ttft, itl)",
            ["metric"],
            registry=r,
        )
        self.slo = Gauge(SLO_SECONDS, "The SLOs the planner holds, p90 seconds (ttft, itl)", ["metric"], registry=r)
        self.reason = Gauge(
            REASON,
            "1 for the reason of each role's latest decision, 0 for the others (the decisions counter's reasons)",
            ["role", "reason"],
            registry=r,
        )
        self.decisions = Counter(
            DECISIONS,
            "Decisions per role and reason (steady, load_up, load_down, slo_miss, cooldown, min, max, budget)",
            ["role", "reason"],
            registry=r,
        )

    def record(
        self,
        decision: Decision,
        workload: Workload,
        observed_rate: float,
        capacity: InstanceCapacity,
        states: dict[tuple[str, str], int],
        ttft_p90_s: float | None,
        itl_p90_s: float | None,
        slo: Slo,
    ) -> None:
        for role in ROLES:
            self.desired.labels(role=role).set(decision.of(role).desired)
            self.needed.labels(role=role).set(decision.of(role).needed)
            self.decisions.labels(role=role, reason=decision.of(role).reason).inc()
            for reason in REASONS:
                self.reason.labels(role=role, reason=reason).set(1 if reason == decision.of(role).reason else 0)
            for state in STATES:
                self.instances.labels(role=role, state=state).set(states.get((role, state), 0))
        self.capacity.labels(role="prefill").set(capacity.prefill_rate)
        self.capacity.labels(role="decode").set(capacity.decode_rate)
        self.predicted_rate.set(workload.request_rate)
        self.observed_rate.set(observed_rate)
        self.mean_tokens.labels(kind="prompt").set(workload.prompt_tokens)
        self.mean_tokens.labels(kind="output").set(workload.output_tokens)
        self.slo.labels(metric="ttft").set(slo.ttft_s)
        self.slo.labels(metric="itl").set(slo.itl_s)
        for metric, value in (("ttft", ttft_p90_s), ("itl", itl_p90_s)):
            if value is not None:
                self.observed_p90.labels(metric=metric).set(value)
