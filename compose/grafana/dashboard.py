"""splitserve's Grafana dashboard, built with grafana-foundation-sdk (its typed builders are
Grafana's own dashboard schema, so what they build is a valid dashboard without a running
Grafana). The JSON beside it is this script's output, provisioned by compose:

    python compose/grafana/dashboard.py > compose/grafana/dashboards/splitserve.json

tests/compose/test_observability.py checks that the committed JSON is what this builds.

Panels: gateway-side TTFT, ITL and E2E percentiles, where TTFT went phase by phase (stacked)
and the hand-off after it, and request outcomes; each instance's
queue and running requests, KV use and step time (its own /metrics); KV transfer bytes and
time; the planner's pools, load, capacity, SLO headroom and decisions (its --metrics-port);
the failure counters.
"""

from __future__ import annotations

import json
import sys

from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphDrawStyle, LegendDisplayMode, LegendPlacement, StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef

DATASOURCE = DataSourceRef(type_val="prometheus", uid="splitserve-prometheus")  # compose/grafana/provisioning
WIDTH, HEIGHT = 8, 8  # three panels a row on Grafana's 24-column grid
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def query(expr: str, legend: str, ref_id: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).datasource(DATASOURCE)


def panel(title: str, unit: str, description: str, *queries: prometheus.Dataquery) -> timeseries.Panel:
    built = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(HEIGHT)
        .span(WIDTH)
        .draw_style(GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(10)
        .legend(
            common.VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    for item in queries:
        built = built.with_target(item)
    return built


def percentiles(metric: str, title: str, description: str) -> timeseries.Panel:
    queries = [
        query(
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[$__rate_interval])))", name, chr(ord("A") + i)
        )
        for i, (name, q) in enumerate(QUANTILES)
    ]
    return panel(title, "s", description, *queries)


def stacked_phases(metric: str, title: str, description: str) -> timeseries.Panel:
    """Each phase's mean over the interval, stacked: the stack is the mean of their sum (for
    the TTFT phases, the mean TTFT)."""
    mean = (
        f"sum by (phase) (rate({metric}_sum[$__rate_interval]))"
        f" / sum by (phase) (rate({metric}_count[$__rate_interval]))"
    )
    return (
        panel(title, "s", description, query(mean, "{{phase}}", "A"))
        .stacking(common.StackingConfig().mode(StackingMode.NORMAL))
        .fill_opacity(60)
    )


def per_instance(expr: str, ref_id: str = "A") -> prometheus.Dataquery:
    return query(expr, "{{role}} {{instance}}", ref_id)


def build() -> dashboard.Dashboard:
    return (
        dashboard.Dashboard("splitserve")
        .uid("splitserve")
        .description(
            "Disaggregated prefill/decode serving: latency as clients see it, P and D load, KV transfers, failures"
        )
        .tags(["splitserve"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .with_row(dashboard.Row("Latency at the gateway"))
        .with_panel(
            percentiles(
                "splitserve_time_to_first_token_seconds", "Time to first token", "Arrival to the first token sent"
            )
        )
        .with_panel(
            percentiles(
                "splitserve_inter_token_latency_seconds", "Inter-token latency", "Gap between successive output tokens"
            )
        )
        .with_panel(
            percentiles("splitserve_e2e_request_latency_seconds", "End-to-end latency", "Arrival to the last token")
        )
        .with_panel(
            stacked_phases(
                "splitserve_ttft_phase_seconds",
                "Where TTFT went",
                "Mean time to first token by phase, stacked: the gateway's queue, the prefilling instance's queue "
                "and computation, the KV publish, and the transport between them (docs/observability.md)",
            )
        )
        .with_panel(
            panel(
                "TTFT phases, p90",
                "s",
                "The 90th percentile of each TTFT phase on its own (percentiles do not add up: the stack beside "
                "shows means)",
                query(
                    "histogram_quantile(0.9, sum by (le, phase) "
                    "(rate(splitserve_ttft_phase_seconds_bucket[$__rate_interval])))",
                    "{{phase}}",
                    "A",
                ),
            )
        )
        .with_panel(
            stacked_phases(
                "splitserve_handoff_phase_seconds",
                "Hand-off to decode",
                "Mean hand-off after the first token, stacked: the decode instance's wait for blocks, the KV pull "
                "and the first decode step (the gap before the second token)",
            )
        )
        .with_row(dashboard.Row("Prefill and decode instances"))
        .with_panel(
            panel(
                "Waiting requests",
                "short",
                "Queued on each instance (D: holding a KV handle, not yet pulled)",
                per_instance("splitserve_engine_num_waiting"),
            )
        )
        .with_panel(
            panel(
                "Running requests", "short", "Running on each instance", per_instance("splitserve_engine_num_running")
            )
        )
        .with_panel(
            panel(
                "KV cache use",
                "percentunit",
                "Share of each instance's KV blocks in use",
                per_instance("splitserve_engine_kv_usage"),
            )
        )
        .with_panel(
            panel(
                "Step time",
                "s",
                "Mean model time of one engine step",
                per_instance(
                    "rate(splitserve_engine_step_seconds_total[$__rate_interval])"
                    " / rate(splitserve_engine_steps_total[$__rate_interval])"
                ),
            )
        )
        .with_panel(
            panel(
                "Phases on each instance",
                "s",
                "Mean seconds of each phase of the requests an instance served (its own /metrics): queue, prompt "
                "computation and KV publish on prefill; wait for blocks, KV pull and first step on decode",
                query(
                    "sum by (role, instance, phase) (rate(splitserve_engine_phase_seconds_sum[$__rate_interval]))"
                    " / sum by (role, instance, phase) (rate(splitserve_engine_phase_seconds_count[$__rate_interval]))",
                    "{{instance}} {{phase}}",
                    "A",
                ),
            )
        )
        .with_panel(
            panel(
                "Prefill throughput",
                "short",
                "Prompt tokens per second over each prefill instance's recent steps",
                per_instance('splitserve_engine_prefill_tokens_per_second{role="prefill"}'),
            )
        )
        .with_panel(
            panel(
                "Requests",
                "reqps",
                "Finished requests per second by outcome, and requests refused with 429",
                query("sum by (status) (rate(splitserve_requests_total[$__rate_interval]))", "{{status}}", "A"),
                query("rate(splitserve_requests_rejected_total[$__rate_interval])", "rejected (429)", "B"),
            )
        )
        .with_row(dashboard.Row("KV transfers"))
        .with_panel(
            panel(
                "KV transfer bytes",
                "Bps",
                "KV bytes per second each decode instance pulls from prefill",
                per_instance('rate(splitserve_engine_kv_transfer_bytes_total{role="decode"}[$__rate_interval])'),
            )
        )
        .with_panel(
            panel(
                "KV transfer time",
                "s",
                "Mean duration of one pull, and the gateway's p90 over hand-offs",
                per_instance(
                    'rate(splitserve_engine_kv_transfer_seconds_total{role="decode"}[$__rate_interval])'
                    ' / rate(splitserve_engine_kv_transfers_total{role="decode"}[$__rate_interval])'
                ),
                query(
                    "histogram_quantile(0.9, sum by (le) "
                    "(rate(splitserve_kv_transfer_seconds_bucket[$__rate_interval])))",
                    "p90 (gateway)",
                    "B",
                ),
            )
        )
        .with_panel(
            panel(
                "Leases",
                "short",
                "KV leases renewed and expired on each prefill instance, per second",
                query(
                    'rate(splitserve_engine_lease_renewals_total{role="prefill"}[$__rate_interval])',
                    "renewals {{instance}}",
                    "A",
                ),
                query(
                    'rate(splitserve_engine_lease_expiries_total{role="prefill"}[$__rate_interval])',
                    "expiries {{instance}}",
                    "B",
                ),
            )
        )
        .with_row(dashboard.Row("Planner"))
        .with_panel(
            panel(
                "Pools: wanted and ready",
                "short",
                "Instances the planner wants per role, what the predicted rate needs before its bounds and "
                "cooldowns, and those ready (every gateway routes to them); its own metrics (docs/planner.md)",
                query("splitserve_planner_desired_instances", "{{role}} desired", "A"),
                query("splitserve_planner_needed_instances", "{{role}} needed", "B"),
                query('splitserve_planner_instances{state="ready"}', "{{role}} ready", "C"),
            )
        )
        .with_panel(
            panel(
                "Load and capacity",
                "reqps",
                "Requests a second observed and the forecast the planner sizes for, beside what one instance of "
                "each role sustains within the SLOs and what the wanted pool does",
                query("splitserve_planner_observed_request_rate", "observed", "A"),
                query("splitserve_planner_predicted_request_rate", "predicted", "B"),
                query("splitserve_planner_capacity_requests_per_second", "{{role}}, one instance", "C"),
                query(
                    "splitserve_planner_capacity_requests_per_second * on (role) splitserve_planner_desired_instances",
                    "{{role}}, wanted pool",
                    "D",
                ),
            )
        )
        .with_panel(
            panel(
                "SLO headroom",
                "percentunit",
                "1 - observed p90 / SLO for TTFT and ITL, from the gateways' histograms each interval: above 0 "
                "within the SLO, below 0 missed (the planner then adds an instance)",
                query(
                    "1 - splitserve_planner_observed_p90_seconds / on (metric) splitserve_planner_slo_seconds",
                    "{{metric}}",
                    "A",
                ),
            )
        )
        .with_panel(
            panel(
                "Planner decisions",
                "short",
                "Decisions per role and reason over the interval: steady, load up or down, an SLO missed, or held "
                "by a cooldown, a bound or the budget",
                query(
                    "sum by (role, reason) (increase(splitserve_planner_decisions_total[$__rate_interval]))",
                    "{{role}} {{reason}}",
                    "A",
                ),
            )
        )
        .with_row(dashboard.Row("Errors"))
        .with_panel(
            panel(
                "Failed requests",
                "reqps",
                "Requests that ended other than by a stop or the length limit",
                query(
                    'sum by (status) (rate(splitserve_requests_total{status!~"stop|length"}[$__rate_interval]))',
                    "{{status}}",
                    "A",
                ),
            )
        )
        .with_panel(
            panel(
                "KV failures",
                "short",
                "Per second: failed pulls, recomputes, hand-backs, refused handles, pulls cut off",
                *[
                    query(
                        f"sum(rate(splitserve_engine_{name}_total[$__rate_interval]))",
                        name.replace("_", " "),
                        chr(ord("A") + i),
                    )
                    for i, name in enumerate(
                        ("kv_pull_failures", "kv_recomputes", "kv_handbacks", "kv_handles_refused", "pulls_cut_off")
                    )
                ],
            )
        )
        .with_panel(
            panel(
                "Instances up",
                "short",
                "1 while an instance's engine runs (its scrape), and Prometheus's own view of each target",
                per_instance("splitserve_engine_up"),
                query("up", "{{job}} {{instance}} scrape", "B"),
            )
        )
    )


def dashboard_json() -> str:
    return (
        json.dumps(json.loads(JSONEncoder(sort_keys=True, indent=2).encode(build().build())), indent=2, sort_keys=True)
        + "\n"
    )


if __name__ == "__main__":
    sys.stdout.write(dashboard_json())
