"""Prefill and decode instances at different tensor-parallel sizes, as real processes over
real UCX (and through a real LMCache store on Redis): every decode rank pulls its KV heads
from the prefill ranks that hold them (or from the store, where each head is kept apart), the
tokens equal the colocated engine's, the bytes of a pull are the missing blocks' KV once
whatever the pair, D's prefix-cache hits still skip their pulls, and no block leaks after a
finish or an abort."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM
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

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 4, 8, 16
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # float32, every head


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp-pd"), num_attention_heads=8, num_key_value_heads=NUM_KV_HEADS)


@pytest.fixture(scope="module")
def colocated(model: Path) -> LLM:
    return LLM(model=str(model), kv_cache_memory=1 << 22, dtype="float32")


def instance(role: str, model: Path, tensor_parallel_size: int, *extra: str) -> Iterator[Service]:
    flags = ("--dtype", "float32", "--tensor-parallel-size", str(tensor_parallel_size), *extra)
    with running(role, model, *flags) as service:
        yield service


@pytest.fixture(scope="module")
def prefill_tp1(model: Path) -> Iterator[Service]:
    yield from instance("prefill", model, 1)


@pytest.fixture(scope="module")
def prefill_tp2(model: Path) -> Iterator[Service]:
    yield from instance("prefill", model, 2)


@pytest.fixture(scope="module")
def decode_tp1(model: Path) -> Iterator[Service]:
    yield from instance("decode", model, 1)


@pytest.fixture(scope="module")
def decode_tp2(model: Path) -> Iterator[Service]:
    yield from instance("decode", model, 2)


@pytest.fixture(scope="module")
def decode_tp4(model: Path) -> Iterator[Service]:
    yield from instance("decode", model, 4)


@pytest.fixture(scope="module")
def lmcache_prefill_tp2(model: Path, redis_url: str) -> Iterator[Service]:
    yield from instance("prefill", model, 2, "--kv-connector", "lmcache", "--lmcache-url", redis_url)


@pytest.fixture(scope="module")
def lmcache_decode_tp1(model: Path, redis_url: str) -> Iterator[Service]:
    yield from instance("decode", model, 1, "--kv-connector", "lmcache", "--lmcache-url", redis_url)


@pytest.fixture(scope="module")
def lmcache_prefill_tp1(model: Path, redis_url: str) -> Iterator[Service]:
    yield from instance("prefill", model, 1, "--kv-connector", "lmcache", "--lmcache-url", redis_url)


@pytest.fixture(scope="module")
def lmcache_decode_tp2(model: Path, redis_url: str) -> Iterator[Service]:
    yield from instance("decode", model, 2, "--kv-connector", "lmcache", "--lmcache-url", redis_url)


@pytest.mark.parametrize(
    ("prefill_name", "decode_name"),
    [
        ("prefill_tp2", "decode_tp1"),
        ("prefill_tp1", "decode_tp2"),
        ("prefill_tp2", "decode_tp4"),
        ("lmcache_prefill_tp2", "lmcache_decode_tp1"),
        ("lmcache_prefill_tp1", "lmcache_decode_tp2"),
    ],
    ids=["P2-D1", "P1-D2", "P2-D4", "lmcache-P2-D1", "lmcache-P1-D2"],
)
def test_tokens_equal_colocated_and_every_head_moves_once(
    request: pytest.FixtureRequest, colocated: LLM, prefill_name: str, decode_name: str
) -> None:
    prefill: Service = request.getfixturevalue(prefill_name)
    decode: Service = request.getfixturevalue(decode_name)
    shared = random_prompts([32], seed=71)[0]
    for index, suffix in enumerate(random_prompts([9, 20], seed=72)):
        prompt = shared + suffix
        request_id = f"{prefill_name}-{decode_name}-{index}"
        prefilled = run_prefill(prefill, request_id, prompt)
        assert len(prefilled.kv.rank_connector_addresses) == (2 if prefill_name.endswith("prefill_tp2") else 0)
        tokens, responses = run_decode(decode, request_id, prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        # From the second on, the shared 32 tokens are D's own prefix-cache hits: not pulled.
        assert_pulled_only_what_decode_lacked(transfer, len(prefilled.kv.block_ids), 0 if index == 0 else 2)
        if "lmcache" in prefill_name:
            assert len(prefilled.kv.chunk_digests) == NUM_KV_HEADS  # one chunk, each head apart
            # A store hands out whole chunks (here one: the whole prompt), each head once.
            assert transfer.num_bytes == len(prompt) * BLOCK_BYTES // BLOCK_SIZE
        else:
            assert transfer.num_bytes == transfer.num_pulled_blocks * BLOCK_BYTES
    assert_all_free(prefill, decode)


def test_an_abort_during_the_hand_off_frees_every_block(prefill_tp2: Service, decode_tp4: Service) -> None:
    assert_an_abort_during_the_hand_off_frees_every_block(
        prefill_tp2, decode_tp4, "abort-tp", random_prompts([40], seed=73)[0]
    )


@pytest.mark.slow
def test_smollm2_prefilled_at_tp3_decodes_at_tp1() -> None:
    """The embedded model (3 KV heads): each of P's ranks holds one, D pulls all three."""
    with (
        running("prefill", _embedded(), "--dtype", "float32", "--tensor-parallel-size", "3") as prefill,
        running("decode", _embedded(), "--dtype", "float32") as decode,
    ):
        colocated = LLM(model=str(_embedded()), dtype="float32", kv_cache_memory=1 << 22)
        prompt = colocated.tokenizer.encode("The capital of France is")
        prefilled = run_prefill(prefill, "smol-tp3", prompt)
        tokens, responses = run_decode(decode, "smol-tp3", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        assert responses[0].kv_transfer.num_pulled_blocks == len(prefilled.kv.block_ids)
        assert_all_free(prefill, decode)


def _embedded() -> Path:
    from engine.default_model import default_model_path

    return default_model_path()
