"""The planner's series: what it decided, for which load, and its instances by state."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from planner.capacity import InstanceCapacity, Slo, Workload
from planner.decision import Decision, RoleDecision
from planner.metrics import PlannerMetrics


def samples(metrics: PlannerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_decision_is_recorded_with_its_reasons_and_the_load_it_was_made_for() -> None:
    metrics = PlannerMetrics()
    decision = Decision(RoleDecision(2, 2, "load_up"), RoleDecision(3, 5, "max"))
    states = {("prefill", "ready"): 1, ("prefill", "starting"): 1, ("decode", "draining"): 1}
    for _ in range(2):
        metrics.record(
            decision,
            Workload(4.5, 900, 150),
            4.0,
            InstanceCapacity(2.5, 1.2, 9),
            states,
            ttft_p90_s=0.4,
            itl_p90_s=None,
            slo=Slo(ttft_s=1.0, itl_s=0.05),
        )
    values = samples(metrics)
    assert values[("splitserve_planner_desired_instances", (("role", "decode"),))] == 3
    assert values[("splitserve_planner_needed_instances", (("role", "decode"),))] == 5
    assert values[("splitserve_planner_instances", (("role", "prefill"), ("state", "starting")))] == 1
    assert values[("splitserve_planner_instances", (("role", "decode"), ("state", "ready")))] == 0
    assert values[("splitserve_planner_capacity_requests_per_second", (("role", "prefill"),))] == 2.5
    assert values[("splitserve_planner_predicted_request_rate", ())] == 4.5
    assert values[("splitserve_planner_observed_p90_seconds", (("metric", "ttft"),))] == 0.4
    assert ("splitserve_planner_observed_p90_seconds", (("metric", "itl"),)) not in values
    assert values[("splitserve_planner_decisions_total", (("reason", "max"), ("role", "decode")))] == 2
    assert values[("splitserve_planner_slo_seconds", (("metric", "itl"),))] == 0.05
    assert values[("splitserve_planner_reason", (("reason", "max"), ("role", "decode")))] == 1
    assert values[("splitserve_planner_reason", (("reason", "load_up"), ("role", "decode")))] == 0
    assert values[("splitserve_planner_reason", (("reason", "load_up"), ("role", "prefill")))] == 1
