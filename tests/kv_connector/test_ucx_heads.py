"""UCX pulls between ranks that split the KV heads differently (tensor parallelism of
different sizes): each decode rank's connector pulls exactly its heads from the prefill
ranks the head plan names, into the right place of its blocks; bytes move once; a handle's
token serves each planned span once. Real ucxx over loopback, every rank's connector in this
process."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest
import torch

from kv_connector.base import KVSource, KVTransferError
from kv_connector.fingerprint import Fingerprint
from kv_connector.head_plan import plan_head_pulls
from kv_connector.ucx import UCXConnector

pytest.importorskip("ucxx")

UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 12, 2, 4, 4, 8
BLOCKS = [2, 5, 6, 7, 10]  # P's, for the request
TOKEN = b"\x07" * 16


def fingerprint(tensor_parallel_size: int) -> Fingerprint:
    return Fingerprint("tiny-heads", "float32", BLOCK_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, tensor_parallel_size)


def rank_caches(world_size: int, whole: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each rank's cache: its heads of ``whole`` (zeros without one), in the engine's layout."""
    per_rank = NUM_KV_HEADS // world_size
    full = whole if whole is not None else torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [full[..., r * per_rank : (r + 1) * per_rank, :].contiguous() for r in range(world_size)]


def transfer(source_size: int, target_size: int, pulls_per_span: int = 1) -> tuple[torch.Tensor, list[int], list]:
    """P at ``source_size`` ranks publishes; D at ``target_size`` pulls every rank's plan into
    blocks 0..4 (the first a local prefix hit, not pulled). Returns P's whole cache, D's
    caches put back together, the bytes each D rank pulled, and each span's outcome past
    the first pull."""
    os.environ.update(UCX_ENV)
    whole = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    local_blocks = [0, 1, 3, 4, 8]

    async def scenario() -> tuple[torch.Tensor, list[int], list]:
        prefill = [
            UCXConnector(cache, fingerprint(source_size), tensor_parallel_rank=rank)
            for rank, cache in enumerate(rank_caches(source_size, whole))
        ]
        decode = [
            UCXConnector(cache, fingerprint(target_size), tensor_parallel_rank=rank)
            for rank, cache in enumerate(rank_caches(target_size))
        ]
        addresses = [await connector.start("127.0.0.1", 0) for connector in prefill]
        for connector in prefill:
            await connector.publish("r", BLOCKS, [], pull_token=TOKEN)
        source = KVSource("r", addresses[0], tuple(BLOCKS), 20, fingerprint(source_size), pull_token=TOKEN)
        pulled, repeats = [], []
        try:
            for rank, spans in enumerate(plan_head_pulls(NUM_KV_HEADS, source_size, target_size)):
                num_bytes = 0
                for span in spans:
                    for attempt in range(pulls_per_span):
                        try:
                            stats = await decode[rank].pull_heads(
                                source,
                                addresses[span.source_rank],
                                local_blocks,
                                1,
                                10.0,
                                source_heads=(span.source_start, span.num_heads),
                                target_start=span.target_start,
                            )
                        except KVTransferError as error:
                            repeats.append(str(error))
                            continue
                        if attempt:
                            repeats.append("served again")
                        num_bytes += stats.num_bytes
                pulled.append(num_bytes)
        finally:
            for connector in [*prefill, *decode]:
                await connector.close()
        merged = torch.cat([connector.kv_cache for connector in decode], dim=4)
        return merged, pulled, repeats

    merged, pulled, repeats = asyncio.run(scenario())
    expected = torch.zeros_like(whole)
    expected[local_blocks[1:]] = whole[BLOCKS[1:]]
    assert torch.equal(merged, expected)
    return whole, pulled, repeats


@pytest.mark.parametrize(("source_size", "target_size"), [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2), (4, 1)])
def test_each_decode_rank_gets_its_heads_and_the_bytes_move_once(source_size: int, target_size: int) -> None:
    whole, pulled, _ = transfer(source_size, target_size)
    block_bytes = whole[0].nbytes
    assert sum(pulled) == 4 * block_bytes  # 4 missing blocks, every head once, whatever the pair


def test_a_token_serves_each_planned_span_once() -> None:
    _, _, repeats = transfer(2, 1, pulls_per_span=2)
    assert len(repeats) == 2 and all("was spent" in outcome for outcome in repeats), repeats


def test_tensor_parallel_sizes_do_not_make_fingerprints_incompatible() -> None:
    fingerprint(2).check_compatible(fingerprint(1))
    with pytest.raises(ValueError, match="num_kv_heads"):
        fingerprint(2).check_compatible(replace(fingerprint(1), num_kv_heads=8))
