"""A colocated instance with n-gram speculation, served for real (tiny model, gRPC on loopback):
its load report counts drafts and accepted tokens, and the gateway's /metrics exports them with
the acceptance rate."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2, generation_pb2_grpc

from gateway.discovery import StaticDiscovery
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from serving import colocated
from serving.instance import Instance, serve
from tests.checkpoints import make_checkpoint

# The tiny model's greedy output loops on this prompt (tests/engine/spec_decode), so lookups hit.
PROMPT = [9, 8, 7, 6] * 6 + [9, 8]


def test_load_report_and_metrics_carry_the_speculation_counts(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    colocated.add_arguments(parser)
    args = parser.parse_args([
        "--model", str(make_checkpoint(tmp_path)), "--port", "0", "--kv-cache-memory", str(1 << 22), "--dtype", "float32",
        "--num-speculative-tokens", "3", "--speculative-ngram-min", "1",
    ])
    instance = Instance.create(args, "colocated")
    servicer = colocated.ColocatedServicer(instance)

    async def scenario() -> None:
        stop = asyncio.Event()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(serve(
            instance, args, lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
            ready=ready.set_result, stop=stop,
        ))
        address = await ready
        pool = InstancePool(stale_after_s=30.0)
        channel = grpc.aio.insecure_channel(address)
        try:
            request = generation_pb2.GenerateRequest(
                request_id="r", token_ids=generation_pb2.TokenIds(ids=PROMPT),
                sampling=generation_pb2.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
            )
            num_tokens = 0
            async for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
                num_tokens += len(response.token_ids)
            assert num_tokens == 48
            stats = instance.engine.core.scheduler.spec_stats
            assert stats.num_accepted_tokens > 0
            # The report is the engine thread's snapshot after its last step.
            for _ in range(50):
                load = disaggregation_pb2_grpc.LoadStub(channel)
                report = await load.GetLoadReport(disaggregation_pb2.LoadReportRequest(), timeout=5)
                if report.counters.num_spec_draft_tokens == stats.num_draft_tokens:
                    break
                await asyncio.sleep(0.1)
            assert report.counters.num_spec_draft_tokens == stats.num_draft_tokens
            assert report.counters.num_spec_accepted_tokens == stats.num_accepted_tokens

            await StaticDiscovery(pool, {"colocated": [address]}, interval_s=0.2).poll_once()
            text = GatewayMetrics(pool).render().decode()
            labels = f'{{address="{address}",instance="{report.instance_id}",role="colocated"}}'
            assert f"splitserve_instance_spec_draft_tokens_total{labels} {float(stats.num_draft_tokens)}" in text
            assert f"splitserve_instance_spec_accepted_tokens_total{labels} {float(stats.num_accepted_tokens)}" in text
            assert f"splitserve_instance_spec_acceptance_rate{labels} {stats.acceptance_rate}" in text
        finally:
            await channel.close()
            await pool.close()
            stop.set()
            await serving

    asyncio.run(scenario())
