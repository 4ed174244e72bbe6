"""A colocated instance started with ``--speculative-config`` naming Medusa heads, served for
real (tiny model, gRPC on loopback): its greedy stream equals the offline engine's output
without speculation, its heads drafted, and every block is free after."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.engine.spec_decode.medusa_heads import make_medusa_heads
from tests.serving.inprocess import colocated_instance, serving

PROMPT = [9, 8, 7, 6] * 6 + [9, 8]


def test_a_colocated_instance_speculates_with_medusa_heads(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model")
    heads = make_medusa_heads(tmp_path / "heads", "medusa-1")
    expected = (
        LLM(model=str(model), dtype="float32", kv_cache_memory=1 << 22)
        .generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    config = json.dumps({"method": "medusa", "model": str(heads), "num_speculative_tokens": 2})
    args, instance = colocated_instance(model, "--dtype", "float32", "--speculative-config", config)

    async def scenario() -> list[int]:
        async with serving(instance, args) as address, grpc.aio.insecure_channel(address) as channel:
            request = generation_pb2.GenerateRequest(
                request_id="r",
                token_ids=generation_pb2.TokenIds(ids=PROMPT),
                sampling=generation_pb2.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
            )
            tokens: list[int] = []
            async for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
                tokens.extend(response.token_ids)
            return tokens

    assert asyncio.run(scenario()) == list(expected)
    core = instance.engine.core
    assert core.runner.medusa is not None and core.scheduler.spec_stats.num_draft_tokens > 0
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_total_blocks
