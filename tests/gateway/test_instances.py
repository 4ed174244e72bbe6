"""Ranking and pairing in the gateway's instance pool, with hand-made load reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from splitserve.v1 import disaggregation_pb2

from gateway.instances import InstancePool

FINGERPRINT = disaggregation_pb2.Fingerprint(model="m", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)
OTHER = disaggregation_pb2.Fingerprint(model="other", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)


def report(role: str, waiting: int = 0, running: int = 0, fingerprint: disaggregation_pb2.Fingerprint = FINGERPRINT, max_model_len: int = 2048):
    return disaggregation_pb2.LoadReport(
        instance_id=f"{role}-{waiting}-{running}", role=role, num_waiting=waiting, num_running=running,
        fingerprint=fingerprint, max_model_len=max_model_len,
    )


def with_pool(test: Callable[[InstancePool], None], stale_after_s: float = 5.0) -> None:
    """grpc.aio channels need a running loop; the pool itself is synchronous."""

    async def body() -> None:
        pool = InstancePool(stale_after_s=stale_after_s)
        try:
            test(pool)
        finally:
            await pool.close()

    asyncio.run(body())


def test_ranks_by_four_times_waiting_plus_running() -> None:
    def check(pool: InstancePool) -> None:
        for address, waiting, running in (("a:1", 1, 0), ("b:1", 0, 3), ("c:1", 0, 5)):
            pool.add(address, "decode")
            pool.record_report(address, report("decode", waiting, running), serving=True)
        # scores: a = 4, b = 3, c = 5
        assert pool.pick("decode").address == "b:1"
        # b now has one request the report cannot show yet: 4 * 1 + 3 = 7 > a's 4
        assert pool.pick("decode").address == "a:1"
        # a: 4 * 2 = 8; b: 7; c: 5
        assert pool.pick("decode").address == "c:1"
        pool.record_report("b:1", report("decode", 0, 0), serving=True)  # a fresh report resets the guess
        assert pool.pick("decode").address == "b:1"

    with_pool(check)


def test_skips_unhealthy_stale_and_failed_instances() -> None:
    def check(pool: InstancePool) -> None:
        for address in ("a:1", "b:1", "c:1", "d:1"):
            pool.add(address, "decode")
            pool.record_report(address, report("decode"), serving=True)
        pool.record_report("a:1", report("decode"), serving=False)  # draining
        pool.instances["b:1"].reported_at = time.monotonic() - 10  # stale
        pool.record_failure(pool.instances["c:1"])  # an RPC to it failed after its last report
        assert [s.address for s in pool.healthy("decode")] == ["d:1"]
        pool.record_report("c:1", report("decode"), serving=True)  # it reported again: back
        assert {s.address for s in pool.healthy("decode")} == {"c:1", "d:1"}
        pool.record_unreachable("d:1")
        assert [s.address for s in pool.healthy("decode")] == ["c:1"]
        assert pool.pick("decode", exclude=[pool.instances["c:1"]]) is None

    with_pool(check)


def test_never_pairs_mismatched_fingerprints() -> None:
    def check(pool: InstancePool) -> None:
        pool.add("p-other:1", "prefill")
        pool.record_report("p-other:1", report("prefill", fingerprint=OTHER), serving=True)
        pool.add("d:1", "decode")
        pool.record_report("d:1", report("decode"), serving=True)
        assert not pool.is_ready() and pool.pick_prefill() is None
        pool.add("p:1", "prefill")
        pool.record_report("p:1", report("prefill", waiting=9), serving=True)  # busier, but compatible
        assert pool.is_ready()
        assert pool.pick_prefill().address == "p:1"
        assert pool.pick("decode", fingerprint=OTHER) is None
        assert pool.pick("decode", fingerprint=FINGERPRINT).address == "d:1"

    with_pool(check)


def test_max_model_len_is_the_smallest_reported() -> None:
    def check(pool: InstancePool) -> None:
        assert pool.max_model_len() is None
        pool.add("p:1", "prefill")
        pool.record_report("p:1", report("prefill", max_model_len=4096), serving=True)
        pool.add("d:1", "decode")
        pool.record_report("d:1", report("decode", max_model_len=1024), serving=True)
        assert pool.max_model_len() == 1024

    with_pool(check)


def test_removed_instances_are_forgotten() -> None:
    def check(pool: InstancePool) -> None:
        pool.add("d:1", "decode")
        pool.record_report("d:1", report("decode"), serving=True)
        pool.remove("d:1")
        assert pool.healthy("decode") == [] and "d:1" not in pool.instances

    with_pool(check)
