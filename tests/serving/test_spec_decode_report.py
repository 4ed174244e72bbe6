"""A colocated instance with n-gram speculation, served for real (tiny model, gRPC on loopback):
its load report counts drafts and accepted tokens, and the gateway's /metrics exports them with
the acceptance rate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from gateway.discovery import StaticDiscovery
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.serving.inprocess import colocated_instance, serving

# The tiny model's greedy output loops on this prompt (tests/engine/spec_decode), so lookups hit.
PROMPT = [9, 8, 7, 6] * 6 + [9, 8]


def test_load_report_and_metrics_carry_the_speculation_counts(tmp_path: Path) -> None:
    args, instance = colocated_instance(
        make_checkpoint(tmp_path), "--dtype", "float32", "--num-speculative-tokens", "3", "--speculative-ngram-min", "1"
    )

    async def scenario() -> None:
        async with serving(instance, args) as address:
            pool = InstancePool(stale_after_s=30.0)
            channel = grpc.aio.insecure_channel(address)
            try:
                request = generation_pb2.GenerateRequest(
                    request_id="r",
                    token_ids=generation_pb2.TokenIds(ids=PROMPT),
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
                assert (
                    f"splitserve_instance_spec_accepted_tokens_total{labels} {float(stats.num_accepted_tokens)}" in text
                )
                acceptance_rate = stats.num_accepted_tokens / stats.num_draft_tokens
                assert f"splitserve_instance_spec_acceptance_rate{labels} {acceptance_rate}" in text
            finally:
                await channel.close()
                await pool.close()

    asyncio.run(scenario())
