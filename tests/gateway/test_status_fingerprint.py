"""The status page's fingerprint column (``gateway/status.py``): each instance's model and KV
shape and how it is split over ranks, from the fingerprint in its load report; a pipeline split
shows beside the tensor-parallel size, and Medusa heads whose drafts cross the hand-off after
it. The page itself renders the text as it comes (tests/gateway/test_status_page.py)."""

from __future__ import annotations

import asyncio

from gateway.instances import InstancePool
from gateway.status import RecentLatencies, status_snapshot
from splitserve.v1 import disaggregation_pb2


def make_report(
    instance_id: str, tensor_parallel_size: int, stage_first_layers: list[int], draft: str = ""
) -> disaggregation_pb2.LoadReport:
    fingerprint = disaggregation_pb2.Fingerprint(
        model="m",
        dtype="bfloat16",
        block_size=16,
        num_layers=4,
        num_kv_heads=2,
        head_dim=8,
        tensor_parallel_size=tensor_parallel_size,
        stage_first_layers=stage_first_layers,
        draft=draft,
    )
    return disaggregation_pb2.LoadReport(instance_id=instance_id, fingerprint=fingerprint)


def test_the_fingerprint_column_shows_the_pipeline_split_where_there_is_one() -> None:
    reports = {
        "127.0.0.1:1": ("prefill", make_report("one-stage", 2, [0])),
        "127.0.0.1:2": ("decode", make_report("two-stages", 2, [0, 2])),
        "127.0.0.1:3": ("decode", make_report("unset", 0, [])),  # an instance older than the fields
        "127.0.0.1:4": ("decode", make_report("medusa", 1, [0], "medusa:heads-0123")),
    }

    async def snapshot() -> dict[str, str | None]:
        pool = InstancePool(stale_after_s=30.0)
        try:
            for address, (role, report) in reports.items():
                pool.add(address, role)
                pool.record_report(address, report, serving=True)
            status = status_snapshot(pool, RecentLatencies(), "m", ready=True)
        finally:
            await pool.close()
        return {shown.instance_id: shown.fingerprint for shown in status.instances}

    shape = "m bfloat16 block 16, 4 layers, 2 KV heads x 8"
    assert asyncio.run(snapshot()) == {
        "one-stage": f"{shape}, TP 2",
        "two-stages": f"{shape}, TP 2 x PP 2",
        "unset": f"{shape}, TP 1",
        "medusa": f"{shape}, TP 1, drafts by medusa:heads-0123",
    }
