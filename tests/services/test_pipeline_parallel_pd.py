"""Prefill and decode instances of different TP x PP shapes, as real processes over real UCX:
every decode rank pulls its (layer range, head span)s from the prefill ranks that hold them
(kv_connector/layer_plan.py), the tokens equal the colocated engine's, the bytes of a pull are
the missing blocks' KV once whatever the pair, D's prefix-cache hits still skip their pulls,
and no block is left in use after a finish or an abort."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM
from splitserve.v1 import disaggregation_pb2
from tests.checkpoints import make_checkpoint, random_prompts
from tests.services.client import (
    assert_all_free,
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
