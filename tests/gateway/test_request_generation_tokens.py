"""Each finished request's output tokens, counted once at its end (the planner's mean output
length); a request that failed is not a finished one."""

from __future__ import annotations

from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics, RequestTimer


def test_a_finished_request_counts_its_output_tokens_once_and_a_failed_one_not_at_all() -> None:
    metrics = GatewayMetrics(InstancePool(stale_after_s=5.0))
    timer = RequestTimer(metrics)
    timer.tokens_sent(1)
    timer.tokens_sent(3)  # tokens that arrived together
    timer.finished("length")
    failed = RequestTimer(metrics)
    failed.tokens_sent(2)
    failed.finished("error_503")
    registry = metrics.registry
    assert registry.get_sample_value("splitserve_request_generation_tokens_count") == 1
    assert registry.get_sample_value("splitserve_request_generation_tokens_sum") == 4
    assert registry.get_sample_value("splitserve_request_generation_tokens_bucket", {"le": "4.0"}) == 1
    assert registry.get_sample_value("splitserve_request_generation_tokens_bucket", {"le": "2.0"}) == 0
    assert registry.get_sample_value("splitserve_generation_tokens_total") == 6  # every token sent
