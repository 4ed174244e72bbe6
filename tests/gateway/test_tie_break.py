"""Each gateway's tie order (gateway/tie_break.py): gateways given their slots start their bursts
on disjoint instances; the order is the same whatever order the instances were found in."""

from __future__ import annotations

import asyncio

import pytest

from gateway.instances import InstancePool
from gateway.tie_break import GatewaySlot
from splitserve.v1 import disaggregation_pb2

INSTANCES = [(f"decode-{i}", f"127.0.0.1:{9000 + i}") for i in range(16)]


def first(slot: GatewaySlot, num: int, instances: list[tuple[str, str]] = INSTANCES) -> list[str]:
    order = slot.tie_order(instances)
    return sorted(order, key=order.__getitem__)[:num]


def test_one_gateway_orders_instances_by_id() -> None:
    by_id = [address for _, address in sorted(INSTANCES)]
    assert first(GatewaySlot(), 16) == by_id
    assert first(GatewaySlot(), 16, list(reversed(INSTANCES))) == by_id


def test_gateways_start_on_disjoint_instances() -> None:
    for num_slots in (2, 4):
        share = len(INSTANCES) // num_slots
        starts = [set(first(GatewaySlot(slot, num_slots), share)) for slot in range(num_slots)]
        assert set.union(*starts) == {address for _, address in INSTANCES}  # each its own, none shared


def test_the_processes_of_replicas_take_slots_of_their_own() -> None:
    slots = {GatewaySlot.of(replica, 2, process, 3) for replica in range(2) for process in range(3)}
    assert slots == {GatewaySlot(slot, 6) for slot in range(6)}


def test_an_index_outside_the_count_is_refused() -> None:
    with pytest.raises(ValueError, match="--gateway-index 2 must be at least 0 and below --num-gateways 2"):
        GatewaySlot.of(2, 2, 0, 1)
    with pytest.raises(ValueError):
        GatewaySlot(1, 1)


def test_two_gateways_pools_route_a_burst_each_to_disjoint_idle_instances() -> None:
    """The same 16 idle decode instances in two gateways' pools, neither seeing the other's
    dispatches: 8 picks each land on 8 instances each, none shared. (With one tie order, both
    gateways' picks were the same 8.)"""

    async def body() -> list[list[str]]:
        picked = []
        for slot in range(2):
            pool = InstancePool(stale_after_s=60.0, slot=GatewaySlot(slot, 2))
            try:
                for address in (f"127.0.0.1:{9000 + i}" for i in range(16)):
                    pool.add(address, "decode")
                    pool.record_report(address, decode_report(address), serving=True)
                picked.append([choice.address for choice in (pool.pick("decode") for _ in range(8)) if choice])
            finally:
                await pool.close()
        return picked

    first, second = asyncio.run(body())
    assert len(set(first)) == len(set(second)) == 8
    assert not set(first) & set(second)


def decode_report(address: str) -> disaggregation_pb2.LoadReport:
    return disaggregation_pb2.LoadReport(instance_id=f"decode-{address}", role="decode", max_model_len=2048)
