"""Prefill and decode with a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3), as real
processes on loopback, through both connectors: the hand-off moves the 8-bit rows and their
scales, as many bytes as the blocks hold in a real cache of that format and under 0.55 of
what the same blocks hold in a real bf16 cache, D's greedy tokens are those of a
colocated engine with the same KV dtype, local prefix hits still spare their blocks, every block
is free afterwards, and an instance with another KV dtype refuses the handle naming both."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from engine import LLM
from engine.kv_cache_dtype import KVCacheDType
from engine.kv_cache_utils import cdiv
from tests.checkpoints import make_checkpoint, random_prompts
from tests.services.client import assert_all_free, expected_tokens, run_decode, run_prefill
from tests.services.processes import Service, running

BLOCK_SIZE = 16
SECRET = "kv-dtype-cluster-secret-7f3a"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64, as SmolLM2's, so that a row's scale weighs what it does there; 2 layers, 2 KV heads.
    return make_checkpoint(
        tmp_path_factory.mktemp("llama-d64"), hidden_size=256, num_attention_heads=4, intermediate_size=256
    )


def block_bytes(engine: LLM) -> int:
    """The bytes of one block in ``engine``'s KV cache tensor, as allocated."""
    return engine.engine.runner.kv_cache[0].nbytes


@pytest.fixture(scope="module")
def bf16_block_bytes(model: Path) -> int:
    """What a block of this model holds in a bf16 KV cache: a bf16 engine's, as allocated."""
    with LLM(model=str(model), dtype="bfloat16", kv_cache_memory=1 << 22) as engine:
        return block_bytes(engine)


@pytest.fixture(scope="module")
def colocated_with(model: Path) -> Callable[[KVCacheDType], LLM]:
    """A colocated engine with the given KV dtype, made once when first asked for: what P and D must give."""

    @functools.cache
    def engine(kv_cache_dtype: KVCacheDType) -> LLM:
        return LLM(model=str(model), kv_cache_memory=1 << 22, kv_cache_dtype=kv_cache_dtype)

    return engine


@pytest.fixture(scope="module")
def plain_decode(model: Path) -> Iterator[Service]:
    """A decode instance with the model's own KV dtype (float32 for this checkpoint)."""
    with running("decode", model, secret=SECRET) as service:
        yield service


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def ucx_pair(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[KVCacheDType, Service, Service]]:
    pytest.importorskip("ucxx")
    flags = ("--kv-cache-dtype", request.param)
    with (
        running("prefill", model, *flags, "--lease-seconds", "30", secret=SECRET) as prefill,
        running("decode", model, *flags, secret=SECRET) as decode,
    ):
        yield request.param, prefill, decode


def test_a_quantized_hand_off_over_ucx_moves_half_of_bf16s_bytes(
    ucx_pair: tuple[KVCacheDType, Service, Service],
    colocated_with: Callable[[KVCacheDType], LLM],
    bf16_block_bytes: int,
) -> None:
    kv_cache_dtype, prefill, decode = ucx_pair
    colocated = colocated_with(kv_cache_dtype)
    before = decode.load()
    prompts = random_prompts([3, 16, 17, 40, 70], seed=51)
    for index, prompt in enumerate(prompts):
        prefilled = run_prefill(prefill, f"ucx-{kv_cache_dtype}-{index}", prompt)
        assert prefilled.kv.fingerprint.dtype == f"{kv_cache_dtype}/f32-token-head"
        assert len(prefilled.kv.block_ids) == cdiv(len(prompt), BLOCK_SIZE)
        tokens, responses = run_decode(decode, f"ucx-{kv_cache_dtype}-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        assert not transfer.recomputed and transfer.num_pulled_blocks == len(prefilled.kv.block_ids)
    after = decode.load()
    num_blocks = sum(cdiv(len(prompt), BLOCK_SIZE) for prompt in prompts)
    # UCX moves whole blocks: every row of each, values and scales, as a cache of this format holds them.
    assert after.kv_transfers - before.kv_transfers == len(prompts)
    num_pulled_bytes = after.kv_transfer_bytes - before.kv_transfer_bytes
    assert num_pulled_bytes == num_blocks * block_bytes(colocated)
    assert num_pulled_bytes < 0.55 * num_blocks * bf16_block_bytes, (num_pulled_bytes, num_blocks, bf16_block_bytes)
    assert_all_free(prefill, decode)


def test_a_quantized_decode_reuses_its_own_prefix_hits(
    ucx_pair: tuple[KVCacheDType, Service, Service], colocated_with: Callable[[KVCacheDType], LLM]
) -> None:
    kv_cache_dtype, prefill, decode = ucx_pair
    shared = random_prompts([48], seed=52)[0]  # three full blocks
    transfers = []
    for index, suffix in enumerate(random_prompts([20, 20], seed=53)):
        prompt = shared + suffix
        prefilled = run_prefill(prefill, f"prefix-{kv_cache_dtype}-{index}", prompt)
        tokens, responses = run_decode(decode, f"prefix-{kv_cache_dtype}-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated_with(kv_cache_dtype), prompt)
        transfers.append(responses[0].kv_transfer)
    assert (transfers[0].num_local_hit_blocks, transfers[0].num_pulled_blocks) == (0, 5)
    assert (transfers[1].num_local_hit_blocks, transfers[1].num_pulled_blocks) == (3, 2)
    assert_all_free(prefill, decode)


def test_a_decode_instance_with_another_kv_dtype_refuses_the_handle_naming_both(
    ucx_pair: tuple[KVCacheDType, Service, Service],
    plain_decode: Service,
    colocated_with: Callable[[KVCacheDType], LLM],
) -> None:
    kv_cache_dtype, prefill, decode = ucx_pair
    prompt = random_prompts([20], seed=54)[0]
    prefilled = run_prefill(prefill, f"stranger-{kv_cache_dtype}", prompt)
    with pytest.raises(grpc.RpcError) as raised:
        run_decode(plain_decode, f"stranger-{kv_cache_dtype}", prompt, prefilled)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"dtype: decode has 'float32', prefill has '{kv_cache_dtype}/f32-token-head'" in raised.value.details()
    assert_all_free(plain_decode)
    # The prefill instance still pairs with its own kind.
    tokens, _ = run_decode(decode, f"stranger-{kv_cache_dtype}", prompt, prefilled)
    assert tokens == expected_tokens(colocated_with(kv_cache_dtype), prompt)
    assert_all_free(prefill, decode)


@pytest.fixture(scope="module")
def lmcache_pair(model: Path, redis_url: str) -> Iterator[tuple[Service, Service]]:
    pytest.importorskip("lmcache")
    flags = ("--kv-connector", "lmcache", "--lmcache-url", redis_url, "--kv-cache-dtype", "int8")
    env = {"LMCACHE_TRACK_USAGE": "false"}
    with (
        running("prefill", model, *flags, secret=SECRET, env=env) as prefill,
        running("decode", model, *flags, secret=SECRET, env=env) as decode,
    ):
        yield prefill, decode


@pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")
def test_a_quantized_hand_off_through_lmcache_stores_and_fetches_the_rows_and_scales(
    lmcache_pair: tuple[Service, Service], colocated_with: Callable[[KVCacheDType], LLM]
) -> None:
    prefill, decode = lmcache_pair
    colocated = colocated_with("int8")
    before = decode.load()
    prompts = random_prompts([5, 33, 70], seed=55)
    for index, prompt in enumerate(prompts):
        prefilled = run_prefill(prefill, f"lm-int8-{index}", prompt)
        assert prefilled.kv.connector == "lmcache" and prefilled.kv.fingerprint.dtype == "int8/f32-token-head"
        tokens, responses = run_decode(decode, f"lm-int8-{index}", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        transfer = responses[0].kv_transfer
        assert not transfer.recomputed and transfer.num_pulled_blocks == cdiv(len(prompt), BLOCK_SIZE)
    after = decode.load()
    # The store holds each head of each chunk apart, token rows only (no padding of the last block).
    bytes_per_token = block_bytes(colocated) // BLOCK_SIZE
    assert after.kv_transfer_bytes - before.kv_transfer_bytes == sum(map(len, prompts)) * bytes_per_token
    assert_all_free(prefill, decode)
