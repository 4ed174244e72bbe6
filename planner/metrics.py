"""The planner's decisions as Prometheus series, on its own registry (served by
``splitserve planner --metrics-port``; Grafana and KEDA/HPA read the desired counts from it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.capacity import InstanceCapacity, Workload
from planner.decision import ROLES, Decision


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge(
            "splitserve_planner_desired_instances", "Instances the planner wants per role", ["role"], registry=r
        )
        self.needed = Gauge(
            "splitserve_planner_needed_instances",
            "Instances the predicted rate needs per role, before bounds, cooldowns and the budget",
            ["role"],
            registry=r,
        )
        self.instances = Gauge(
            "splitserve_planner_instances",
            "The planner's instances per role and state (starting: not ready yet; ready: routed to; draining: "
            "finishing its streams before it stops)",
            ["role", "state"],
            registry=r,
        )
        self.capacity = Gauge(
            "splitserve_planner_capacity_requests_per_second",
            "Requests a second one instance of the role sustains within the SLOs, for the predicted mix",
            ["role"],
            registry=r,
        )
        self.predicted_rate = Gauge(
            "splitserve_planner_predicted_request_rate", "Requests a second the planner sizes for", registry=r
        )
        self.observed_rate = Gauge(
            "splitserve_planner_observed_request_rate", "Requests a second dispatched last interval", registry=r
        )
        self.mean_tokens = Gauge(
            "splitserve_planner_mean_tokens", "Mean tokens a request the planner sizes for", ["kind"], registry=r
        )
        self.observed_p90 = Gauge(
            "splitserve_planner_observed_p90_seconds",
            "Last interval's p90 from the gateways' histograms (ttft, itl)",
            ["metric"],
            registry=r,
        )
        self.decisions = Counter(
            "splitserve_planner_decisions",
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
    ) -> None:
        for role in ROLES:
            self.desired.labels(role=role).set(decision.of(role).desired)
            self.needed.labels(role=role).set(decision.of(role).needed)
            self.decisions.labels(role=role, reason=decision.of(role).reason).inc()
            for state in ("starting", "ready", "draining"):
                self.instances.labels(role=role, state=state).set(states.get((role, state), 0))
        self.capacity.labels(role="prefill").set(capacity.prefill_rate)
        self.capacity.labels(role="decode").set(capacity.decode_rate)
        self.predicted_rate.set(workload.request_rate)
        self.observed_rate.set(observed_rate)
        self.mean_tokens.labels(kind="prompt").set(workload.prompt_tokens)
        self.mean_tokens.labels(kind="output").set(workload.output_tokens)
        for metric, value in (("ttft", ttft_p90_s), ("itl", itl_p90_s)):
            if value is not None:
                self.observed_p90.labels(metric=metric).set(value)
