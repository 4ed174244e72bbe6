"""Prefill and decode instances of different TP x PP shapes, as real processes over real UCX:
every decode rank pulls its (layer range, head span)s from the prefill ranks that hold them
(kv_connector/layer_plan.py), the tokens equal the colocated engine's, the bytes of a pull are
the missing blocks' KV once whatever the pair, D's prefix-cache hits still skip their pulls,
and no block is left in use after a finish or an abort. Through a real LMCache store on Redis
too: each P rank stores its heads of its stage's layers, each D rank fetches those of the P
stages its own is made of (the same split, or P's stages joined), and a D stage that would cut
a P stage is refused at the Decode call naming both shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine import LLM
from splitserve.v1 import disaggregation_pb2
from tests.checkpoints import make_checkpoint, random_prompts
from tests.services.client import (
    assert_all_free,
    assert_altered_handle_refused,
    assert_an_abort_during_the_hand_off_frees_every_block,
    assert_pulled_only_what_decode_lacked,
    expected_tokens,
    run_decode,
    run_prefill,
)
from tests.services.processes import Service, running

pytest.importorskip("ucxx")

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 4, 8, 16
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # float32, every layer and head


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("pp-pd"),
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=8,
        num_key_value_heads=NUM_KV_HEADS,
    )


@pytest.fixture(scope="module")
def colocated(model: Path) -> LLM:
    return LLM(model=str(model), kv_cache_memory=1 << 22, dtype="float32")


def instance(role: str, model: Path, *shape: str) -> Iterator[Service]:
    with running(role, model, "--dtype", "float32", *shape) as service:
        yield service


@pytest.fixture(scope="module")
def prefill_pp1(model: Path) -> Iterator[Service]:
    yield from instance("prefill", model)


@pytest.fixture(scope="module")
def prefill_pp2(model: Path) -> Iterator[Service]:
    yield from instance("prefill", model, "--pipeline-parallel-size", "2")  # layers 0-1 and 2-3


@pytest.fixture(scope="module")
def prefill_tp2(model: Path) -> Iterator[Service]:
    yield from instance("prefill", model, "--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def decode_pp1(model: Path) -> Iterator[Service]:
    yield from instance("decode", model)


@pytest.fixture(scope="module")
def decode_pp2(model: Path) -> Iterator[Service]:
    # Layers 0-2 and 3: across P's even stages, so one D stage pulls from both of them.
    yield from instance("decode", model, "--pipeline-parallel-size", "2", "--pipeline-stage-layers", "3,1")


def lmcache(role: str, model: Path, redis_url: str, *shape: str) -> Iterator[Service]:
    yield from instance(role, model, "--kv-connector", "lmcache", "--lmcache-url", redis_url, *shape)


@pytest.fixture(scope="module")
def lmcache_prefill_pp2(model: Path, redis_url: str) -> Iterator[Service]:
    yield from lmcache("prefill", model, redis_url, "--pipeline-parallel-size", "2")  # layers 0-1 and 2-3


@pytest.fixture(scope="module")
def lmcache_decode_pp2(model: Path, redis_url: str) -> Iterator[Service]:
    yield from lmcache("decode", model, redis_url, "--pipeline-parallel-size", "2")  # P's split


@pytest.fixture(scope="module")
def lmcache_decode_pp1(model: Path, redis_url: str) -> Iterator[Service]:
    yield from lmcache("decode", model, redis_url)  # P's two stages joined


def stage_firsts(fingerprint: disaggregation_pb2.Fingerprint) -> list[int]:
    return list(fingerprint.stage_first_layers)


@pytest.mark.parametrize(
    ("prefill_name", "decode_name", "prefill_stages", "seed"),
    # Each pair its own prompts (seed): D's prefix cache outlives a pair, and only the shared
    # part of a pair's own prompts may be a hit.
    [
        ("prefill_pp2", "decode_pp1", [0, 2], 81),
        ("prefill_pp1", "decode_pp2", [0], 83),
        ("prefill_tp2", "decode_pp2", [0], 85),
        ("prefill_pp2", "decode_pp2", [0, 2], 87),
    ],
    ids=["P-PP2-D-PP1", "P-PP1-D-PP2", "P-TP2-D-PP2", "P-PP2-D-PP2-uneven"],
)
def test_tokens_equal_colocated_and_every_layer_and_head_moves_once(
    request: pytest.FixtureRequest,
    colocated: LLM,
    prefill_name: str,
    decode_name: str,
    prefill_stages: list[int],
    seed: int,
) -> None:
    prefill: Service = request.getfixturevalue(prefill_name)
    decode: Service = request.getfixturevalue(decode_name)
    shared = random_prompts([32], seed=seed)[0]
    for index, suffix in enumerate(random_prompts([9, 20], seed=seed + 1)):
        prompt = shared + suffix
        request_id = f"{prefill_name}-{decode_name}-{index}"
        prefilled = run_prefill(prefill, request_id, prompt)
        assert stage_firsts(prefilled.kv.fingerprint) == prefill_stages
        # Every rank of a P of more than one lists its connector, stage-major.
        num_prefill_ranks = 1 if prefill_name == "prefill_pp1" else 2
        assert len(prefilled.kv.rank_connector_addresses) == (num_prefill_ranks if num_prefill_ranks > 1 else 0)
        tokens, responses = run_decode(decode, request_id, prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        # From the second on, the shared 32 tokens are D's own prefix-cache hits: not pulled.
        assert_pulled_only_what_decode_lacked(transfer, len(prefilled.kv.block_ids), 0 if index == 0 else 2)
        assert transfer.num_bytes == transfer.num_pulled_blocks * BLOCK_BYTES
    assert_all_free(prefill, decode)


def test_an_abort_during_the_hand_off_frees_every_block(prefill_pp2: Service, decode_pp2: Service) -> None:
    assert_an_abort_during_the_hand_off_frees_every_block(
        prefill_pp2, decode_pp2, "abort-pp", random_prompts([40], seed=89)[0]
    )


@pytest.mark.slow  # four prefill ranks started for this test alone
def test_prefill_at_tp2_x_pp2_hands_off_to_decode_at_pp2(model: Path, colocated: LLM, decode_pp2: Service) -> None:
    """Four P ranks listed stage-major (rank 0, the instance's own, is the last stage's first);
    each D stage pulls its layers' heads from both ranks of every P stage it overlaps."""
    shape = ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    with running("prefill", model, "--dtype", "float32", *shape) as prefill:
        prompt = random_prompts([41], seed=91)[0]
        prefilled = run_prefill(prefill, "tp2-pp2", prompt)
        assert stage_firsts(prefilled.kv.fingerprint) == [0, 2]
        assert len(prefilled.kv.rank_connector_addresses) == 4
        assert prefilled.kv.rank_connector_addresses[2] == prefilled.kv.connector_address  # stage 1's rank 0
        tokens, responses = run_decode(decode_pp2, "tp2-pp2", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        assert transfer.num_pulled_blocks == len(prefilled.kv.block_ids)  # a prompt D has not seen
        assert transfer.num_bytes == transfer.num_pulled_blocks * BLOCK_BYTES
        assert_all_free(prefill, decode_pp2)


LMCACHE_CHUNK_TOKENS = 256  # the connector's default chunk: a store hands out whole chunks


@pytest.mark.parametrize(
    ("decode_name", "seed"), [("lmcache_decode_pp2", 101), ("lmcache_decode_pp1", 103)], ids=["D-PP2", "D-PP1"]
)
def test_lmcache_stages_store_and_fetch_their_layers_and_prefix_hits_skip_their_chunks(
    request: pytest.FixtureRequest, colocated: LLM, lmcache_prefill_pp2: Service, decode_name: str, seed: int
) -> None:
    """P (PP 2) stores each stage's layers apart, a digest per stage, head and chunk; D fetches
    exactly its layers of the missing chunks: all of a new prompt, and past a shared first chunk
    that is its own prefix-cache hit, only the rest."""
    decode: Service = request.getfixturevalue(decode_name)
    shared = random_prompts([LMCACHE_CHUNK_TOKENS], seed=seed)[0]
    for index, suffix in enumerate(random_prompts([9, 20], seed=seed + 1)):
        prompt = shared + suffix
        request_id = f"lmcache-pp2-{decode_name}-{index}"
        prefilled = run_prefill(lmcache_prefill_pp2, request_id, prompt)
        assert prefilled.kv.connector == "lmcache" and stage_firsts(prefilled.kv.fingerprint) == [0, 2]
        assert len(prefilled.kv.chunk_digests) == 2 * NUM_KV_HEADS * 2  # stages, heads, chunks
        tokens, responses = run_decode(decode, request_id, prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        num_hit_blocks = 0 if index == 0 else LMCACHE_CHUNK_TOKENS // BLOCK_SIZE
        assert_pulled_only_what_decode_lacked(transfer, len(prefilled.kv.block_ids), num_hit_blocks)
        # Every layer and head of the fetched chunks once, whichever D ranks fetched them.
        fetched_tokens = len(prompt) - (0 if index == 0 else LMCACHE_CHUNK_TOKENS)
        assert transfer.num_bytes == fetched_tokens * BLOCK_BYTES // BLOCK_SIZE
    assert_all_free(lmcache_prefill_pp2, decode)


def test_lmcache_abort_during_the_hand_off_frees_every_block(
    lmcache_prefill_pp2: Service, lmcache_decode_pp2: Service
) -> None:
    assert_an_abort_during_the_hand_off_frees_every_block(
        lmcache_prefill_pp2, lmcache_decode_pp2, "abort-lmcache-pp", random_prompts([40], seed=105)[0]
    )


def test_lmcache_decode_stage_cutting_a_prefill_stage_is_refused_naming_both_shapes(
    colocated: LLM, lmcache_prefill_pp2: Service, lmcache_decode_pp2: Service
) -> None:
    """A handle from a P at PP 1 (one object per head of all layers): D's second stage would
    fetch layers 0-1 too, so the Decode call is refused before anything is allocated."""

    def from_pp1(handle: disaggregation_pb2.KVHandle) -> None:
        del handle.fingerprint.stage_first_layers[1:]

    assert_altered_handle_refused(
        lmcache_prefill_pp2,
        lmcache_decode_pp2,
        colocated,
        "lmcache-cut",
        random_prompts([30], seed=107)[0],
        from_pp1,
        grpc.StatusCode.FAILED_PRECONDITION,
        "refusing to pair decode at TP 1 x PP 2 (stages from layers 0, 2) with prefill at TP 1 x PP 1 (stages from "
        "layers 0)",
    )
