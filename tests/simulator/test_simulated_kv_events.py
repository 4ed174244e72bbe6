"""A simulated instance's prefix cache reaches a gateway's index pushed, step by step: the real
engine (its step thread calling ``KVEventLog.end_step``) over a simulated runner, the instance's
own ``LoadServicer`` on a real gRPC server, and the gateway's ``KVEventsSync``; the calls are
counted where they land (cluster/call_counts.py): after the first contact's resync, requests'
blocks come down the subscription and no poll is made."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from cluster.call_counts import CallCounts
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from gateway.kv_events import KVEventsSync
from serving.instance import LoadServicer
from simulator.runner import simulated_runner_factory
from splitserve.v1 import disaggregation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.serving.test_kv_event_pages import indexed, polled_pool
from tests.serving.test_kv_event_stream import calls, wait_until
from tests.simulator.test_simulated_parts import PROFILE


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


def test_a_simulated_instances_blocks_reach_the_index_pushed_without_a_poll(model_path: Path) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(model=str(model_path)), simulated_runner_factory(PROFILE, 1.0))
        await engine.start()
        counts = CallCounts()
        server = grpc.aio.server(interceptors=[counts])
        instance = SimpleNamespace(engine=engine, fingerprint=SimpleNamespace(block_size=engine.core.config.block_size))
        disaggregation_pb2_grpc.add_LoadServicer_to_server(LoadServicer(instance), server)  # type: ignore[arg-type]
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        pool = polled_pool(address, num_total_blocks=PROFILE.num_kv_blocks)
        sync = KVEventsSync(pool, pool.index, interval_s=0.05)
        task = asyncio.create_task(sync.run())
        log = engine.core.kv_events
        try:
            await wait_until(lambda: calls(counts) == (2, 1), "first contact: a resync, a poll, a subscription")
            for index in range(3):
                prompt = [100 + index] * 40 + [7] * 8  # 3 full blocks of 16 each
                async for _ in engine.generate(prompt, SamplingParams(max_tokens=2)):
                    pass
                num_blocks = 3 * (index + 1)
                await wait_until(
                    lambda n=num_blocks: (
                        len(indexed(pool, address)) == n and pool.index.cursor(address) == (log.epoch, log.last_seq)
                    ),
                    f"request {index}'s blocks indexed",
                )
                assert indexed(pool, address) == set(log.snapshot().stored)
            assert calls(counts) == (2, 1)  # pushed: no poll, no new subscription
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pool.close()
            await server.stop(grace=None)
            await engine.stop()

    asyncio.run(scenario())
