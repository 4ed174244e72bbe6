"""The routing preset gives each prefill instance CPUs of its own: two instances sharing
cores stall each other's OpenMP teams, which the benchmark would measure instead of the router."""

from __future__ import annotations

from bench.routing import prefill_cpu_lists


def test_each_prefill_instance_gets_an_equal_share_of_the_cpus() -> None:
    assert prefill_cpu_lists(2, {0, 1}) == "0|1"
    assert prefill_cpu_lists(2, {4, 5, 6, 7, 9}) == "4,5|6,7"
    assert prefill_cpu_lists(2, {3}) is None
