"""The EAGLE draft's KV over a prompt through LMCache (kv_connector/lmcache_draft_kv.py), P's and
D's connectors in this process over a real Redis server: D fetches exactly what P stored (whole,
whatever D's prefix-cache hits, keeping nothing in LMCache's buffer), under keys of P's publish
and drafter only, expiring with the chunks; a handle without the draft's digest brings the blocks
alone; a missing object, other bytes or another shape fail the pull before a block is written."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import warnings
from collections.abc import Awaitable, Callable

import pytest
import torch

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
with warnings.catch_warnings():  # lmcache's opentelemetry import warns about its own deprecations
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("lmcache")
    from kv_connector.lmcache_connector import LMCacheConnector

from cluster.handle_signing import new_pull_token
from engine.spec_decode.prompt_draft_kv import DraftKVShape, PromptDraftKV
from kv_connector.base import KVSource, KVTransferError, TransferStats
from kv_connector.fingerprint import Fingerprint
from tests.kv_connector.lmcache_peer import CHUNK_SIZE, PROMPT, PUBLISHED_BLOCKS, SHAPE, fingerprint, seeded_cache

pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")

STORE_KEY, SALT = bytes(range(32)), "tenant-a"
DRAFT = "eagle:draft-0123"
DRAFT_SHAPE = DraftKVShape(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
DRAFT_START = 20  # P's own prefix-cache hit: its draft computed the entries from here on
LOCAL_BLOCKS = [0, 3, 11, 6]


def drafted(draft: str = DRAFT) -> Fingerprint:
    return dataclasses.replace(fingerprint(), draft=draft)


def prompt_draft_kv() -> PromptDraftKV:
    kv = torch.randn(1, 2, len(PROMPT) - DRAFT_START, 2, 8, generator=torch.Generator().manual_seed(3))
    return PromptDraftKV(DRAFT_START, kv)


def source(chunk_digests: tuple[bytes, ...], draft_kv_digest: bytes, pull_token: bytes) -> KVSource:
    return KVSource(
        request_id="r",
        address="",
        block_ids=tuple(PUBLISHED_BLOCKS),
        num_tokens=len(PROMPT),
        fingerprint=drafted(),
        token_ids=tuple(PROMPT),
        pull_token=pull_token,
        cache_salt=SALT,
        chunk_digests=chunk_digests,
        draft_kv_digest=draft_kv_digest,
    )


def connector(url: str, cache: torch.Tensor, draft: str = DRAFT) -> LMCacheConnector:
    return LMCacheConnector(cache, drafted(draft), remote_url=url, chunk_size=CHUNK_SIZE, store_key=STORE_KEY)


Scenario = Callable[[LMCacheConnector, LMCacheConnector, KVSource], Awaitable[None]]


def published(url: str, scenario: Scenario, decode_draft: str = DRAFT) -> None:
    """P publishes PROMPT's blocks and its draft KV; ``scenario`` gets P's connector, a started D
    connector (of ``decode_draft``, its cache zeroed) and the source of the handle P would sign."""

    async def run() -> None:
        prefill = connector(url, seeded_cache(7))
        decode = connector(url, torch.zeros(SHAPE, dtype=torch.bfloat16), decode_draft)
        await prefill.start("127.0.0.1", 0)
        await decode.start("127.0.0.1", 0)
        try:
            token = new_pull_token()  # one per handle, as the prefill service makes them: keys of its own
            kv = await prefill.publish("r", PUBLISHED_BLOCKS, PROMPT, pull_token=token, cache_salt=SALT)
            digest = await prefill.publish_draft_kv("r", prompt_draft_kv(), token, SALT)
            assert len(digest) == 32
            await scenario(prefill, decode, source(kv.chunk_digests, digest, token))
        finally:
            await prefill.close()
            await decode.close()

    asyncio.run(run())


async def pulled(
    decode: LMCacheConnector, src: KVSource, num_local_hit_blocks: int = 0, shape: DraftKVShape = DRAFT_SHAPE
) -> tuple[TransferStats, PromptDraftKV | None]:
    decode.kv_cache.zero_()
    return await decode.pull_with_draft_kv(src, LOCAL_BLOCKS, num_local_hit_blocks, 10.0, shape)


def test_d_fetches_the_draft_kv_p_stored_with_the_blocks_whatever_it_holds(redis_url: str) -> None:
    """The draft KV arrives whole with the blocks D lacks (none, some, all of them held), counted
    in the pull's bytes and messages; a handle without a draft digest brings the blocks alone."""
    draft_bytes = prompt_draft_kv().kv.nbytes

    async def scenario(prefill: LMCacheConnector, decode: LMCacheConnector, src: KVSource) -> None:
        cache = decode.kv_cache
        for num_local_hit_blocks in (0, 2, 4):
            plain = await decode.pull(src, LOCAL_BLOCKS, num_local_hit_blocks, 10.0)
            stats, draft_kv = await pulled(decode, src, num_local_hit_blocks)
            assert draft_kv is not None and draft_kv.start == DRAFT_START
            assert torch.equal(draft_kv.kv, prompt_draft_kv().kv)
            assert stats.num_blocks == plain.num_blocks == 4 - num_local_hit_blocks
            assert (stats.num_bytes, stats.num_messages) == (plain.num_bytes + draft_bytes, plain.num_messages + 1)
            held = slice(num_local_hit_blocks, 3)  # the last block is partial
            assert torch.equal(cache[LOCAL_BLOCKS[held]], seeded_cache(7)[PUBLISHED_BLOCKS[held]])
        stats, draft_kv = await pulled(decode, dataclasses.replace(src, draft_kv_digest=b""))
        assert draft_kv is None and stats.num_blocks == 4 and cache.any()
        # Nothing fetched stays in LMCache's buffer on D (its local CPU cache is off).
        assert decode._engine is not None
        assert not decode._engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache

    published(redis_url, scenario)


def test_keys_name_the_publish_and_the_drafter_and_expire(redis_url: str) -> None:
    """A D with another drafter, or pulling under another salt or pull token, computes other keys
    and misses (nothing written); the object expires with the chunks."""
    import redis

    async def scenario(prefill: LMCacheConnector, decode: LMCacheConnector, src: KVSource) -> None:
        for wrong in (dataclasses.replace(src, cache_salt="tenant-b"), dataclasses.replace(src, pull_token=bytes(16))):
            with pytest.raises(KVTransferError, match="has no draft KV of 'r'.*another draft, cache salt or KV"):
                await pulled(decode, wrong)
            assert not decode.kv_cache.any()
        key = prefill._draft_kv_key(SALT, src.pull_token, len(PROMPT), torch.float32).to_string()
        client = redis.Redis.from_url(redis_url)
        ttls = [client.pttl(key + suffix) for suffix in ("kv_bytes", "metadata")]
        assert all(0 < ttl <= prefill.ttl_s * 1000 for ttl in ttls), ttls

    published(redis_url, scenario)

    async def other_drafter(prefill: LMCacheConnector, decode: LMCacheConnector, src: KVSource) -> None:
        with pytest.raises(KVTransferError, match="has no draft KV of 'r'"):
            await pulled(decode, dataclasses.replace(src, fingerprint=drafted("eagle:other")))
        assert not decode.kv_cache.any()

    published(redis_url, other_drafter, decode_draft="eagle:other")


def test_other_bytes_another_shape_or_no_object_fail_the_pull_before_a_block_is_written(redis_url: str) -> None:
    import redis

    async def scenario(prefill: LMCacheConnector, decode: LMCacheConnector, src: KVSource) -> None:
        key = prefill._draft_kv_key(SALT, src.pull_token, len(PROMPT), torch.float32).to_string() + "kv_bytes"
        client = redis.Redis.from_url(redis_url)
        genuine = client.get(key)
        client.set(key, bytes(byte ^ 0x21 for byte in genuine))
        with pytest.raises(KVTransferError, match="returned other bytes for the draft KV than the prefill instance"):
            await pulled(decode, src)
        assert not decode.kv_cache.any()
        client.set(key, genuine)
        wider = dataclasses.replace(DRAFT_SHAPE, num_kv_heads=4)
        offered = r"draft KV entries of \[1, 2, 2, 8\] float32, expected \[1, 2, 4, 8\]"
        with pytest.raises(KVTransferError, match=offered):
            await pulled(decode, src, shape=wider)
        assert not decode.kv_cache.any()
        client.delete(key)
        with pytest.raises(KVTransferError, match="has no draft KV of 'r'"):
            await pulled(decode, src)
        assert not decode.kv_cache.any()

    published(redis_url, scenario)
