"""Ranking and pairing in the gateway's instance pool, with hand-made load reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.instance_limits import InstanceLimits, Overloaded, estimated_wait_s
from gateway.instances import InstancePool
from gateway.prefix_index import PromptBlocks
from splitserve.v1 import disaggregation_pb2
from tests.stores import free_port

FINGERPRINT = disaggregation_pb2.Fingerprint(
    model="m", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=16
)
OTHER = disaggregation_pb2.Fingerprint(
    model="other", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=16
)


def report(
    role: str,
    waiting: int = 0,
    running: int = 0,
    fingerprint: disaggregation_pb2.Fingerprint = FINGERPRINT,
    max_model_len: int = 2048,
):
    return disaggregation_pb2.LoadReport(
        instance_id=f"{role}-{waiting}-{running}",
        role=role,
        num_waiting=waiting,
        num_running=running,
        fingerprint=fingerprint,
        max_model_len=max_model_len,
    )


def with_pool(
    test: Callable[[InstancePool], None], stale_after_s: float = 5.0, limits: InstanceLimits | None = None
) -> None:
    """grpc.aio channels need a running loop; the pool itself is synchronous."""

    async def body() -> None:
        pool = InstancePool(stale_after_s=stale_after_s, limits=limits or InstanceLimits())
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


def test_the_reason_no_request_can_be_served_names_each_unhealthy_instance() -> None:
    def check(pool: InstancePool) -> None:
        assert pool.unready_reason() == "no instance is known"
        pool.add("p-other:1", "prefill")
        pool.record_report("p-other:1", report("prefill", fingerprint=OTHER), serving=True)
        pool.add("d:1", "decode")
        pool.record_report("d:1", report("decode"), serving=True)
        assert not pool.is_ready()
        assert "shares its KV fingerprint" in pool.unready_reason()  # both healthy, never a pair
        for address in ("p-draining:1", "p-stale:1", "p-failed:1"):
            pool.add(address, "prefill")
            pool.record_report(address, report("prefill"), serving=True)
        pool.record_report("p-draining:1", report("prefill"), serving=False)
        pool.instances["p-stale:1"].reported_at = time.monotonic() - 10
        pool.record_failure(pool.instances["p-failed:1"])
        assert not pool.is_ready()
        reasons = dict(reason.split(": ", 1) for reason in pool.unready_reason().split("; "))
        assert set(reasons) == {
            "prefill prefill-0-0 at p-draining:1",
            "prefill prefill-0-0 at p-stale:1",
            "prefill prefill-0-0 at p-failed:1",
        }
        assert reasons["prefill prefill-0-0 at p-draining:1"].startswith("not serving")
        assert "s old (--stale-after 5)" in reasons["prefill prefill-0-0 at p-stale:1"]
        assert reasons["prefill prefill-0-0 at p-failed:1"].startswith("a call to it failed")

    with_pool(check)


def test_an_instance_restarted_at_its_address_is_routed_to_only_once_its_channel_reconnects() -> None:
    # A real gRPC server, stopped and started again on its port, as a restarted container is:
    # its registration says it is back before the gateway's channel has left its reconnect
    # backoff, in which every call fails at once. Healthy must mean "a call made now is sent".
    address = f"127.0.0.1:{free_port()}"
    check = health_pb2.HealthCheckRequest()

    async def serve() -> grpc.aio.Server:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(address)
        await server.start()
        return server

    async def body() -> None:
        pool = InstancePool(stale_after_s=60.0)
        server = await serve()
        try:
            stub = health_pb2_grpc.HealthStub(pool.add(address, "decode").channel)
            await stub.Check(check, timeout=5)
            await server.stop(None)
            for _ in range(4):  # calls while it is down (a pick before the registration expired)
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Check(check, timeout=1)
            server = await serve()
            deadline = time.monotonic() + 120  # a safety net
            while True:
                pool.record_report(address, report("decode"), serving=True)  # its new registration
                if pool.healthy("decode"):
                    await stub.Check(check, timeout=5)  # fails at once inside the backoff
                    break
                assert time.monotonic() < deadline, "the channel never reconnected"
                await asyncio.sleep(0.02)
        finally:
            await server.stop(None)
            await pool.close()

    asyncio.run(body())


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


def test_never_pairs_instances_whose_kv_caches_store_other_dtypes() -> None:
    """--kv-cache-dtype int8 on P, the model's dtype on D: D cannot read P's rows, so no pair (the
    fingerprint's dtype is the KV cache's, scale layout included)."""
    int8 = disaggregation_pb2.Fingerprint()
    int8.CopyFrom(FINGERPRINT)
    int8.dtype = "int8/f32-token-head"
    fp8 = disaggregation_pb2.Fingerprint()
    fp8.CopyFrom(FINGERPRINT)
    fp8.dtype = "fp8_e4m3/f32-token-head"

    def check(pool: InstancePool) -> None:
        pool.add("p-int8:1", "prefill")
        pool.record_report("p-int8:1", report("prefill", fingerprint=int8), serving=True)
        pool.add("d:1", "decode")
        pool.record_report("d:1", report("decode"), serving=True)  # bfloat16 KV
        pool.add("d-fp8:1", "decode")
        pool.record_report("d-fp8:1", report("decode", fingerprint=fp8), serving=True)
        assert not pool.is_ready() and pool.pick_prefill() is None
        assert pool.pick("decode", fingerprint=int8) is None
        pool.add("d-int8:1", "decode")
        pool.record_report("d-int8:1", report("decode", waiting=9, fingerprint=int8), serving=True)
        assert pool.is_ready() and pool.pick_prefill().address == "p-int8:1"
        assert pool.pick("decode", fingerprint=int8).address == "d-int8:1"  # busier, but the only one that reads it

    with_pool(check)


def test_instances_at_different_tensor_parallel_sizes_pair() -> None:
    """A pull maps one split of the KV heads onto another: P at TP 2 pairs with D at TP 1."""
    split = disaggregation_pb2.Fingerprint()
    split.CopyFrom(FINGERPRINT)
    split.tensor_parallel_size = 2

    def check(pool: InstancePool) -> None:
        pool.add("p:1", "prefill")
        pool.record_report("p:1", report("prefill", fingerprint=split), serving=True)
        pool.add("d:1", "decode")
        pool.record_report("d:1", report("decode"), serving=True)
        assert pool.is_ready() and pool.pick_prefill().address == "p:1"
        assert pool.pick("decode", fingerprint=split).address == "d:1"

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


def queued(role: str, pending_tokens: int, tokens_per_s: float, waiting: int = 0) -> disaggregation_pb2.LoadReport:
    message = report(role, waiting=waiting)
    message.num_pending_prefill_tokens, message.prefill_tokens_per_s = pending_tokens, tokens_per_s
    return message


def add_pair(pool: InstancePool, prefills: dict[str, disaggregation_pb2.LoadReport]) -> None:
    pool.add("d:1", "decode")
    pool.record_report("d:1", report("decode"), serving=True)
    for address, message in prefills.items():
        pool.add(address, "prefill")
        pool.record_report(address, message, serving=True)


def test_estimated_wait_is_queued_prompt_tokens_over_the_measured_rate() -> None:
    assert estimated_wait_s(queued("prefill", 3000, 1000.0), num_dispatched_tokens=1000) == 4.0
    assert estimated_wait_s(queued("prefill", 3000, 0.0), num_dispatched_tokens=1000) == 0.0  # not measured yet
    assert estimated_wait_s(None, 0) == 0.0


def test_queue_delay_limit_skips_long_queues_and_refuses_when_all_are_long() -> None:
    def check(pool: InstancePool) -> None:
        # p:1 ranks first (no waiting requests) but holds 5 s of prompts; p:2 holds 1 s.
        add_pair(pool, {"p:1": queued("prefill", 5000, 1000.0), "p:2": queued("prefill", 1000, 1000.0, waiting=3)})
        assert pool.pick_prefill(num_prompt_tokens=500).address == "p:2"  # 1 s of wait: admitted
        assert pool.pick_prefill(num_prompt_tokens=500).address == "p:2"  # 1.5 s: the dispatched tokens count
        with pytest.raises(Overloaded) as raised:
            pool.pick_prefill(num_prompt_tokens=500)  # p:2 now 2 s, p:1 5 s: both over
        assert raised.value.retry_after_s == 1  # p:2 is 0.5 s over: rounded up to whole seconds
        assert "--max-queue-delay 1.5 s" in str(raised.value)
        # Re-prefills of admitted requests are not refused, and go to the preferred instance.
        preferred = pool.instances["p:1"]
        assert pool.pick_prefill(num_prompt_tokens=500, prefer=preferred, exempt=True) is preferred
        # Decode instances take any admitted request.
        assert pool.pick("decode").address == "d:1"

    with_pool(check, limits=InstanceLimits(max_queue_delay_s=1.5))


def test_a_prompt_stops_counting_as_queued_once_computed_or_reported() -> None:
    def check(pool: InstancePool) -> None:
        add_pair(pool, {"p:1": queued("prefill", 0, 1000.0)})
        p1 = pool.instances["p:1"]
        assert pool.pick_prefill(num_prompt_tokens=1400) is p1
        with p1.call(1400) as prefilled:
            with pytest.raises(Overloaded):  # 1.4 s queued behind it
                pool.pick_prefill(num_prompt_tokens=100)
            prefilled()  # P has computed it: no wait left, without waiting for the next poll
            assert (p1.num_dispatched, p1.num_dispatched_tokens) == (0, 0)
            assert pool.pick_prefill(num_prompt_tokens=100) is p1
        assert (p1.num_dispatched, p1.num_dispatched_tokens) == (1, 100)  # settled once, not again at the block's end
        with p1.call(100):
            pool.record_report("p:1", queued("prefill", 100, 1000.0), serving=True)  # the report shows it queued
            assert pool.pick_prefill(num_prompt_tokens=1400) is p1
        assert (p1.num_dispatched, p1.num_dispatched_tokens) == (1, 1400)  # the report's dispatch count was not touched

    with_pool(check, limits=InstanceLimits(max_queue_delay_s=1.0))


def test_a_started_stream_counts_as_running_until_the_next_report() -> None:
    def check(pool: InstancePool) -> None:
        add_pair(pool, {"p:1": queued("prefill", 0, 0.0)})
        d1 = pool.instances["d:1"]
        assert pool.pick("decode") is d1 and d1.score == 4  # dispatched: waiting there, as far as we know
        with d1.call() as mark_running:
            mark_running()  # its first token came back: running there now
            assert (d1.num_dispatched, d1.num_started, d1.score) == (0, 1, 1)
        assert (d1.num_started, d1.score) == (0, 0)  # over before any report could show it

    with_pool(check)


def test_retry_after_says_when_the_shortest_queue_is_short_enough() -> None:
    def check(pool: InstancePool) -> None:
        add_pair(pool, {"p:1": queued("prefill", 9000, 1000.0), "p:2": queued("prefill", 6200, 1000.0)})
        with pytest.raises(Overloaded) as raised:
            pool.pick_prefill(num_prompt_tokens=100)
        assert raised.value.retry_after_s == 5  # p:2: 6.2 s queued, 1.5 s allowed: 4.7 s over

    with_pool(check, limits=InstanceLimits(max_queue_delay_s=1.5))


def test_inflight_cap_spreads_requests_and_refuses_past_it() -> None:
    def check(pool: InstancePool) -> None:
        add_pair(pool, {"p:1": queued("prefill", 0, 0.0), "p:2": queued("prefill", 0, 0.0, waiting=5)})
        p1, p2 = pool.instances["p:1"], pool.instances["p:2"]
        with p1.call():
            assert pool.pick_prefill() is p2  # p:1 ranks first but is at its cap
            with p2.call(), pytest.raises(Overloaded) as raised:
                pool.pick_prefill()
            assert "--max-inflight-per-instance 1" in str(raised.value)
        assert p1.num_inflight == 0 and pool.pick_prefill() is p1

    with_pool(check, limits=InstanceLimits(max_inflight_per_instance=1))


def test_admission_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="--max-queue-delay"):
        InstanceLimits(max_queue_delay_s=0)
    with pytest.raises(ValueError, match="--max-inflight-per-instance"):
        InstanceLimits(max_inflight_per_instance=0)


def test_kv_routing_weighs_the_cached_prefix_against_queued_work() -> None:
    prompt = PromptBlocks(list(range(1024)))
    chain = prompt.chain(16)
    stored = disaggregation_pb2.KVEvents(
        epoch=1, last_seq=1, snapshot=True, block_size=16, stored=[h.to_bytes(16, "little") for h in chain[:60]]
    )
    empty = disaggregation_pb2.KVEvents(epoch=1, last_seq=1, snapshot=True, block_size=16)

    def check(pool: InstancePool) -> None:
        pool.routing = "kv"
        add_pair(pool, {"p:1": queued("prefill", 0, 1000.0), "p:2": queued("prefill", 500, 1000.0)})
        pool.index.apply("p:1", empty, 1000)
        pool.index.apply("p:2", stored, 1000)  # 960 of the 1024 tokens cached
        p1, p2 = pool.instances["p:1"], pool.instances["p:2"]
        # p:2: (500 + 64) / 1000 = 0.56 s; p:1: 1024 / 1000 s
        assert pool.pick_prefill(num_prompt_tokens=1024, prompt=prompt) is p2
        assert p2.charged_tokens == 64 and p2.num_dispatched_tokens == 64  # only the uncached part queues
        # Its blocks are now predicted on p:2 as well; load it past the hit's worth.
        pool.record_report("p:2", queued("prefill", 2000, 1000.0), serving=True)
        assert pool.pick_prefill(num_prompt_tokens=1024, prompt=prompt) is p1
        assert p1.charged_tokens == 1024
        pool.routing = "load"
        pool.record_report("p:2", queued("prefill", 0, 1000.0), serving=True)
        pool.record_report("p:1", queued("prefill", 0, 1000.0), serving=True)
        assert pool.pick_prefill(num_prompt_tokens=1024, prompt=prompt) is p1  # first of equals: the prefix is ignored

    with_pool(check)


def test_kv_routing_sends_decode_where_the_prompt_needs_fewest_new_blocks() -> None:
    prompt = PromptBlocks(list(range(320)))  # 20 blocks
    chain = prompt.chain(16)

    def check(pool: InstancePool) -> None:
        pool.routing = "kv"
        for address, hits in (("d:1", 0), ("d:2", 20)):
            pool.add(address, "decode")
            message = report("decode", running=1)
            message.num_free_blocks, message.num_total_blocks = 40, 64
            pool.record_report(address, message, serving=True)
            pool.index.apply(
                address,
                disaggregation_pb2.KVEvents(
                    epoch=1,
                    last_seq=1,
                    snapshot=True,
                    block_size=16,
                    stored=[h.to_bytes(16, "little") for h in chain[:hits]],
                ),
                64,
            )
        # d:1: 1 + 4 * 20 / 40 = 3; d:2: 1 + 0
        assert pool.pick("decode", num_prompt_tokens=320, prompt=prompt).address == "d:2"
        assert pool.instances["d:2"].charged_tokens == 0

    with_pool(check)


def test_kv_routing_puts_a_prompt_cached_nowhere_where_it_evicts_least() -> None:
    prompt = PromptBlocks(list(range(1024)))  # 64 blocks
    full = disaggregation_pb2.KVEvents(
        epoch=1,
        last_seq=1,
        snapshot=True,
        block_size=16,
        stored=[(10_000 + i).to_bytes(16, "little") for i in range(100)],
    )
    empty = disaggregation_pb2.KVEvents(epoch=1, last_seq=1, snapshot=True, block_size=16)

    def check(pool: InstancePool) -> None:
        pool.routing = "kv"
        add_pair(pool, {"p:1": queued("prefill", 0, 1500.0), "p:2": queued("prefill", 0, 1000.0)})
        for address in ("p:1", "p:2"):
            pool.instances[address].report.num_total_blocks = 100
        pool.index.apply("p:1", full, 100)  # faster, but its cache is full of other prefixes
        pool.index.apply("p:2", empty, 100)
        # p:1: (1024 + 3 * 64 * 16 evicted) / 1500 = 2.73 s; p:2: 1024 / 1000 = 1.02 s (without the
        # eviction term p:1 would win with 0.68 s, and keep winning every new prefix).
        assert pool.pick_prefill(num_prompt_tokens=1024, prompt=prompt).address == "p:2"

    with_pool(check)
