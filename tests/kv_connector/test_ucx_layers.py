"""UCX pulls between instances of different TP x PP shapes: each decode rank's connector pulls
exactly its (layer range, head span)s from the prefill ranks the layer plan names, into the
right place of its blocks; bytes move once; a handle's token serves each planned span once.
Real ucxx over loopback, every rank's connector in this process."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kv_connector.base import KVSource, KVTransferError
from kv_connector.fingerprint import Fingerprint
from kv_connector.layer_plan import KVLayout, plan_kv_pulls
from kv_connector.ucx import UCXConnector

pytest.importorskip("ucxx")

UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 12, 4, 4, 4, 8
BLOCKS = [2, 5, 6, 7, 10]  # P's, for the request
LOCAL_BLOCKS = [0, 1, 3, 4, 8]  # D's: the first a local prefix hit, not pulled
TOKEN = b"\x07" * 16


def fingerprint(layout: KVLayout) -> Fingerprint:
    return Fingerprint(
        "tiny-layers",
        "float32",
        BLOCK_SIZE,
        NUM_LAYERS,
        NUM_KV_HEADS,
        HEAD_DIM,
        layout.tensor_parallel_size,
        layout.stage_first_layers,
    )


def connectors(layout: KVLayout, whole: torch.Tensor) -> list[UCXConnector]:
    """Each rank's connector over its heads of its stage's layers of ``whole``, stage-major."""
    size = layout.tensor_parallel_size
    per_rank = NUM_KV_HEADS // size
    made = []
    for stage, layers in enumerate(layout.stage_layers()):
        for rank in range(size):
            cache = whole[:, layers.start : layers.stop, ..., rank * per_rank : (rank + 1) * per_rank, :].contiguous()
            made.append(UCXConnector(cache, fingerprint(layout), tensor_parallel_rank=rank, pipeline_stage=stage))
    return made


def merged(layout: KVLayout, ranks: list[UCXConnector]) -> torch.Tensor:
    """The ranks' caches put back together: heads side by side within a stage, stages in order."""
    size = layout.tensor_parallel_size
    stages = [
        torch.cat([ranks[stage * size + rank].kv_cache for rank in range(size)], dim=4)
        for stage in range(layout.num_stages)
    ]
    return torch.cat(stages, dim=1)


def transfer(source: KVLayout, target: KVLayout, again: bool = False) -> tuple[torch.Tensor, int, list[str]]:
    """P at ``source`` publishes; every D rank at ``target`` pulls its plan (``again``: then
    each span once more, alone). Returns D's caches put back together, the bytes pulled, and
    the outcome of each second pull."""
    os.environ.update(UCX_ENV)
    whole = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    async def scenario() -> tuple[torch.Tensor, int, list[str]]:
        prefill = connectors(source, whole)
        decode = connectors(target, torch.zeros_like(whole))
        addresses = [await connector.start("127.0.0.1", 0) for connector in prefill]
        for connector in prefill:
            await connector.publish("r", BLOCKS, [], pull_token=TOKEN)
        kv = KVSource(
            "r", addresses[0], tuple(BLOCKS), 20, fingerprint(source), pull_token=TOKEN, rank_addresses=tuple(addresses)
        )
        outcomes: list[str] = []
        try:
            stats = await asyncio.gather(*(connector.pull(kv, LOCAL_BLOCKS, 1, 10.0) for connector in decode))
            if again:
                plans = plan_kv_pulls(NUM_KV_HEADS, source, target)
                for connector, spans in zip(decode, plans, strict=True):
                    for span in spans:
                        try:
                            await connector.pull_span(kv, addresses[span.source_rank], LOCAL_BLOCKS, 1, 10.0, span)
                            outcomes.append("served again")
                        except KVTransferError as error:
                            outcomes.append(str(error))
        finally:
            for connector in [*prefill, *decode]:
                await connector.close()
        return merged(target, decode), sum(part.num_bytes for part in stats), outcomes

    result, num_bytes, outcomes = asyncio.run(scenario())
    expected = torch.zeros_like(whole)
    expected[LOCAL_BLOCKS[1:]] = whole[BLOCKS[1:]]
    assert torch.equal(result, expected)
    return result, num_bytes, outcomes


SHAPES = {
    "PP2-PP1": (KVLayout(NUM_LAYERS, 1, (0, 2)), KVLayout(NUM_LAYERS)),
    "PP1-PP2": (KVLayout(NUM_LAYERS), KVLayout(NUM_LAYERS, 1, (0, 2))),
    "TP2-PP2": (KVLayout(NUM_LAYERS, 2), KVLayout(NUM_LAYERS, 1, (0, 3))),
    "TP2xPP2-TP1xPP3": (KVLayout(NUM_LAYERS, 2, (0, 1)), KVLayout(NUM_LAYERS, 1, (0, 2, 3))),
    "PP2-TP4xPP2": (KVLayout(NUM_LAYERS, 1, (0, 3)), KVLayout(NUM_LAYERS, 4, (0, 1))),
}


@pytest.mark.parametrize(("source", "target"), list(SHAPES.values()), ids=list(SHAPES))
def test_each_decode_rank_gets_its_layers_and_heads_and_the_bytes_move_once(source: KVLayout, target: KVLayout) -> None:
    _, num_bytes, _ = transfer(source, target)
    block_bytes = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    assert num_bytes == 4 * block_bytes  # 4 missing blocks, every (layer, head) once, whatever the pair


def test_a_token_serves_each_planned_span_once() -> None:
    _, _, outcomes = transfer(*SHAPES["TP2xPP2-TP1xPP3"], again=True)
    assert outcomes and all("was spent" in outcome for outcome in outcomes), outcomes


def test_a_handle_naming_too_few_ranks_is_refused() -> None:
    os.environ.update(UCX_ENV)
    source = KVLayout(NUM_LAYERS, 1, (0, 2))

    async def scenario() -> None:
        (decode,) = connectors(KVLayout(NUM_LAYERS), torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, 4, HEAD_DIM))
        kv = KVSource("r", "127.0.0.1:1", tuple(BLOCKS), 20, fingerprint(source), pull_token=TOKEN)
        with pytest.raises(KVTransferError, match=r"1 rank addresses for a prefill instance of 2 ranks \(TP 1 x PP 2"):
            await decode.pull(kv, LOCAL_BLOCKS, 1, 10.0)

    asyncio.run(scenario())
