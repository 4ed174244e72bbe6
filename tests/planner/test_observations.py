"""Reading the gateways' metrics: sums over gateways, intervals between scrapes, percentiles
from histogram buckets as Prometheus computes them, and when an instance counts as idle."""

from __future__ import annotations

import pytest

from planner.observations import GatewayScraper, histogram_quantile, observe, parse_metrics


def gateway_text(
    dispatched: float,
    prompt_tokens: float,
    finished: float,
    output_tokens: float,
    ttft_buckets: tuple[float, float, float],
    healthy: float = 1.0,
    inflight: float = 0.0,
    running: float = 0.0,
    errors: float = 0.0,
    free_blocks: float = 90.0,
) -> str:
    """A gateway's /metrics with the series the planner reads (the TTFT histogram's buckets
    <= 0.1, <= 1, +Inf; the queue histogram's count is the requests dispatched)."""
    le_01, le_1, le_inf = ttft_buckets
    return f"""# TYPE splitserve_prompt_tokens counter
splitserve_prompt_tokens_total {prompt_tokens}
# TYPE splitserve_request_generation_tokens histogram
splitserve_request_generation_tokens_bucket{{le="+Inf"}} {finished}
splitserve_request_generation_tokens_count {finished}
splitserve_request_generation_tokens_sum {output_tokens}
# TYPE splitserve_requests counter
splitserve_requests_total{{status="length"}} {finished}
splitserve_requests_total{{status="error_503"}} {errors}
# TYPE splitserve_request_queue_time_seconds histogram
splitserve_request_queue_time_seconds_bucket{{le="0.1"}} {dispatched}
splitserve_request_queue_time_seconds_bucket{{le="+Inf"}} {dispatched}
splitserve_request_queue_time_seconds_count {dispatched}
splitserve_request_queue_time_seconds_sum 0.0
# TYPE splitserve_time_to_first_token_seconds histogram
splitserve_time_to_first_token_seconds_bucket{{le="0.1"}} {le_01}
splitserve_time_to_first_token_seconds_bucket{{le="1.0"}} {le_1}
splitserve_time_to_first_token_seconds_bucket{{le="+Inf"}} {le_inf}
splitserve_time_to_first_token_seconds_count {le_inf}
splitserve_time_to_first_token_seconds_sum 0.0
# TYPE splitserve_instance_healthy gauge
splitserve_instance_healthy{{instance="d0",role="decode",address="a:1"}} {healthy}
# TYPE splitserve_instance_inflight_calls gauge
splitserve_instance_inflight_calls{{instance="d0",role="decode",address="a:1"}} {inflight}
# TYPE splitserve_instance_num_running gauge
splitserve_instance_num_running{{instance="d0",role="decode",address="a:1"}} {running}
# TYPE splitserve_instance_num_waiting gauge
splitserve_instance_num_waiting{{instance="d0",role="decode",address="a:1"}} 0
# TYPE splitserve_instance_free_kv_blocks gauge
splitserve_instance_free_kv_blocks{{instance="d0",role="decode",address="a:1"}} {free_blocks}
# TYPE splitserve_instance_total_kv_blocks gauge
splitserve_instance_total_kv_blocks{{instance="d0",role="decode",address="a:1"}} 100
"""


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    before = {0.1: 0.0, 1.0: 0.0, float("inf"): 0.0}
    # 10 observations: 5 under 0.1 s, 5 between 0.1 and 1 s. The 90th is the 9th: 4/5 into (0.1, 1].
    assert histogram_quantile(0.9, before, {0.1: 5.0, 1.0: 10.0, float("inf"): 10.0}) == pytest.approx(0.82)
    # Past the last finite bound the histogram knows no more than that bound.
    assert histogram_quantile(0.9, before, {0.1: 0.0, 1.0: 0.0, float("inf"): 10.0}) == 1.0
    assert histogram_quantile(0.9, before, before) is None


def test_an_interval_is_the_difference_of_two_scrapes_summed_over_gateways() -> None:
    before = parse_metrics([gateway_text(10, 5000, 8, 800, (0, 0, 0))] * 2, at=100.0)
    after = parse_metrics(
        [
            gateway_text(30, 15000, 18, 1800, (5, 10, 10), running=3, errors=1),
            gateway_text(20, 10000, 8, 800, (0, 0, 0), running=3),
        ],
        at=110.0,
    )
    observation = observe(before, after)
    assert observation.request_rate == pytest.approx(3.0)  # (20 + 10) dispatched in 10 s
    assert observation.prompt_tokens == pytest.approx(500.0)  # 15,000 tokens over 30
    assert observation.output_tokens == pytest.approx(100.0)  # 1,000 tokens of the 10 that finished
    assert observation.ttft_p90_s == pytest.approx(0.82)
    assert observation.itl_p90_s is None  # no ITL histogram in these texts
    assert observation.num_failed == 1
    view = observation.instances["d0"]
    assert (view.role, view.num_running, view.free_blocks, view.total_blocks) == ("decode", 3, 90, 100)
    assert observation.kv_usage("decode") == pytest.approx(0.1)


def test_an_instance_is_idle_only_when_no_gateway_routes_or_calls_and_it_holds_nothing() -> None:
    def idle(*gateways: dict[str, float]) -> bool:
        texts = [gateway_text(0, 0, 0, 0, (0, 0, 0), **{"healthy": 0.0, "free_blocks": 100.0, **g}) for g in gateways]
        return parse_metrics(texts, at=0.0).instances["d0"].idle

    assert idle({}, {})
    assert not idle({"free_blocks": 90.0})  # blocks still pinned for a pull, or a stream's
    assert not idle({}, {"healthy": 1.0})  # one gateway still routes to it
    assert not idle({}, {"inflight": 1.0})  # one gateway still has a call on it
    assert not idle({"running": 1.0})


def test_every_address_of_a_gateway_host_is_read_and_resolved_again() -> None:
    # localhost names this host's loopback address(es): a headless Service names each gateway pod.
    scraper = GatewayScraper(["http://localhost:8000/"], every_address=True)
    urls = scraper.urls()
    assert "http://127.0.0.1:8000" in urls and all(url.endswith(":8000") for url in urls)
    assert GatewayScraper(["http://localhost:8000/"]).urls() == ["http://localhost:8000"]
