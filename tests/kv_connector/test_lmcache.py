"""LMCache transfers between two real processes on loopback, through a Redis server and
through LMCache's own ``lm://`` server, each started here on a free port. The store is not
believed: what it returns must match the digests P's publish returned, keys are P's own for
each publish, and a Redis store expires them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
with warnings.catch_warnings():  # lmcache's opentelemetry import warns about its own deprecations
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("lmcache")
    from kv_connector.lmcache_connector import DEFAULT_TTL_S, LMCacheConnector, key_model_name, key_tag

from kv_connector.base import KVSource, KVTransferError
from kv_connector.registry import make_connector
from tests.kv_connector.lmcache_peer import CHUNK_SIZE, PROMPT, PUBLISHED_BLOCKS, SHAPE, fingerprint, seeded_cache
from tests.stalling_proxy import stalling_proxy
from tests.stores import LMCACHE_ENV, free_port, start_lm_server, start_redis, stop

ROOT = Path(__file__).resolve().parents[2]
PEER_ENV = LMCACHE_ENV
TAIL = len(PROMPT) % SHAPE[3]  # tokens in the partial last block
pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")


@pytest.fixture(scope="module")
def lm_url() -> Iterator[str]:
    process, url = start_lm_server()
    try:
        yield url
    finally:
        stop(process)


# The digests of PROMPT's chunks as the prefill peer stored them (its KV is seeded: the same every time).
DIGESTS: list[bytes] = []


@contextlib.contextmanager
def prefill_peer(url: str) -> Iterator[None]:
    """A prefill process (seed 7) that has published PROMPT's KV into the store at ``url``;
    :data:`DIGESTS` holds what its publish returned."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.kv_connector.lmcache_peer", "--url", url, "--seed", "7"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=PEER_ENV,
    )
    try:
        word, _, digests = process.stdout.readline().strip().partition(" ")
        assert word == "published"
        DIGESTS[:] = [bytes.fromhex(digest) for digest in digests.split(",")]
        assert len(DIGESTS) == 4  # 60 tokens in chunks of 32, each of 2 KV heads apart
        yield
    finally:
        process.stdin.close()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def redis_store(redis_url: str) -> Iterator[str]:
    with prefill_peer(redis_url):
        yield redis_url


@pytest.fixture(scope="module")
def lm_store(lm_url: str) -> Iterator[str]:
    with prefill_peer(lm_url):
        yield lm_url


@pytest.fixture(params=["redis", "lm"])
def store(request: pytest.FixtureRequest) -> str:
    """The URL of a store holding PROMPT's KV, once per kind of store."""
    return request.getfixturevalue(f"{request.param}_store")


def source(
    tokens: list[int] = PROMPT,
    model: str = "tiny-0123",
    address: str = "",
    digests: list[bytes] | None = None,
    cache_salt: str = "",
    pull_token: bytes = b"",
) -> KVSource:
    return KVSource(
        request_id="r",
        address=address,
        block_ids=tuple(PUBLISHED_BLOCKS),
        num_tokens=len(tokens),
        fingerprint=fingerprint(model),
        token_ids=tuple(tokens),
        pull_token=pull_token,
        cache_salt=cache_salt,
        chunk_digests=tuple(DIGESTS if digests is None else digests),
    )


def pull(
    cache: torch.Tensor,
    url: str,
    src: KVSource,
    local_blocks: list[int],
    num_local_hit_blocks: int = 0,
    model: str = "tiny-0123",
    timeout_s: float = 10.0,
    store_key: bytes | None = None,
):
    async def run():
        connector = LMCacheConnector(
            cache, fingerprint(model), remote_url=url, chunk_size=CHUNK_SIZE, store_key=store_key
        )
        await connector.start("127.0.0.1", 0)
        try:
            return await connector.pull(src, local_blocks, num_local_hit_blocks, timeout_s)
        finally:
            await connector.close()

    return asyncio.run(run())


def test_pull_copies_the_prompt_into_other_blocks(store: str) -> None:
    remote = seeded_cache(7)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    stats = pull(local, store, source(), [0, 3, 11, 6])
    bytes_per_token = remote[0, :, :, 0].numel() * 2
    assert stats.num_blocks == 4 and stats.num_bytes == len(PROMPT) * bytes_per_token
    for mine, theirs in zip([0, 3, 11], PUBLISHED_BLOCKS[:3], strict=True):
        assert torch.equal(local[mine], remote[theirs])
    # The partial last block: its prompt tokens arrive, the slots after them stay untouched.
    assert torch.equal(local[6, :, :, :TAIL], remote[PUBLISHED_BLOCKS[3], :, :, :TAIL])
    assert not local[6, :, :, TAIL:].any()
    untouched = [b for b in range(SHAPE[0]) if b not in (0, 3, 11, 6)]
    assert not local[untouched].any()


@pytest.mark.parametrize(
    "num_local_hit_blocks", [1, 2, 3]
)  # inside a chunk, on a chunk edge, the partial block's chunk
def test_local_prefix_hits_are_not_pulled(redis_store: str, num_local_hit_blocks: int) -> None:
    remote = seeded_cache(7)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    local_blocks = [1, 2, 3, 4]
    stats = pull(local, redis_store, source(), local_blocks, num_local_hit_blocks=num_local_hit_blocks)
    assert stats.num_blocks == 4 - num_local_hit_blocks
    assert not local[local_blocks[:num_local_hit_blocks]].any()
    for index in range(num_local_hit_blocks, 4):
        tokens = TAIL if index == 3 else SHAPE[3]
        assert torch.equal(local[local_blocks[index], :, :, :tokens], remote[PUBLISHED_BLOCKS[index], :, :, :tokens])


def test_fingerprint_mismatch_is_refused(redis_store: str) -> None:
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    # Caught against the handle's fingerprint, naming both sides...
    with pytest.raises(KVTransferError, match="model: decode has 'tiny-9999', prefill has 'tiny-0123'"):
        pull(local, redis_store, source(), [0, 1, 2, 3], model="tiny-9999")
    # ...and when the handle claims what P is not, P's KV is under other keys: only a miss.
    with pytest.raises(
        KVTransferError,
        match=rf"no KV for tokens 0..59 \(KV head 0\) of 'r' under {key_model_name(fingerprint('tiny-9999'))}",
    ):
        pull(local, redis_store, source(model="tiny-9999"), [0, 1, 2, 3], model="tiny-9999")
    assert not local.any()


def test_unknown_prompt_is_a_miss(redis_store: str) -> None:
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    # A miss, named as one: not the pull's timeout ("timed out"), nor an unreachable store.
    with pytest.raises(KVTransferError, match=r"LMCache at redis://.* has no KV for tokens 0..59 \(KV head 0\) of 'r'"):
        pull(local, redis_store, source([5] * 60), [0, 1, 2, 3])
    # A prompt sharing only the first chunk misses from the second chunk on; nothing is written.
    with pytest.raises(KVTransferError, match=rf"no KV for tokens {CHUNK_SIZE}..59"):
        pull(local, redis_store, source(PROMPT[:40] + [5] * 20), [0, 1, 2, 3])
    assert not local.any()


def test_source_without_token_ids_is_refused(redis_url: str) -> None:
    no_tokens = KVSource("r", "", tuple(PUBLISHED_BLOCKS), len(PROMPT), fingerprint())
    with pytest.raises(KVTransferError, match="no prompt token ids for 'r'"):
        pull(torch.zeros(SHAPE, dtype=torch.bfloat16), redis_url, no_tokens, [0, 1, 2, 3])


def test_unreachable_store_fails_fast() -> None:
    connector = LMCacheConnector(
        torch.zeros(SHAPE, dtype=torch.bfloat16), fingerprint(), remote_url=f"redis://127.0.0.1:{free_port()}"
    )
    # Refused at the probe (the refusal names it), not a probe timed out or an engine built.
    with pytest.raises(KVTransferError, match="is unreachable: ConnectionRefusedError"):
        asyncio.run(connector.start("127.0.0.1", 0))


def test_store_that_goes_away(caplog: pytest.LogCaptureFixture) -> None:
    """P's publish logs (and returns) and D's pull raises within its timeout once the store is gone."""
    process, url = start_redis()

    async def run() -> None:
        prefill = LMCacheConnector(
            seeded_cache(7), fingerprint(), remote_url=url, chunk_size=CHUNK_SIZE, publish_timeout_s=2.0
        )
        decode = LMCacheConnector(
            torch.zeros(SHAPE, dtype=torch.bfloat16), fingerprint(), remote_url=url, chunk_size=CHUNK_SIZE
        )
        await prefill.start("127.0.0.1", 0)
        await decode.start("127.0.0.1", 0)
        stop(process)
        with caplog.at_level(logging.ERROR, logger="kv_connector.lmcache_connector"):
            # Bounded by its publish timeout (2 s); the bound here is only a safety net against a hang.
            published = await asyncio.wait_for(prefill.publish("r", PUBLISHED_BLOCKS, PROMPT), timeout=120.0)
        assert "decode instances will miss it" in caplog.text
        assert published.chunk_digests  # the handle still goes out
        # The pull names the store gone: neither a miss nor its own timeout ("timed out").
        with pytest.raises(KVTransferError, match=f"LMCache store {url} is unreachable"):
            await decode.pull(source(), [0, 1, 2, 3], 0, timeout_s=60.0)
        await prefill.close()
        await decode.close()

    try:
        asyncio.run(run())
    finally:
        if process.poll() is None:
            stop(process)


def test_a_password_protected_store_serves_members_and_refuses_others(capfd: pytest.CaptureFixture[str]) -> None:
    """``redis://:PASSWORD@HOST:PORT`` on both sides moves the KV; a wrong or missing password is
    refused at start with the fix; the password appears in no error and no log line."""
    password = "store-password-5f3a9"
    process, url = start_redis(password)
    try:
        with prefill_peer(url):
            remote, local = seeded_cache(7), torch.zeros(SHAPE, dtype=torch.bfloat16)
            pull(local, url, source(), [0, 3, 11, 6])
            assert torch.equal(local[[0, 3, 11]], remote[PUBLISHED_BLOCKS[:3]])
            assert torch.equal(local[6, :, :, :TAIL], remote[PUBLISHED_BLOCKS[3], :, :, :TAIL])
        for wrong in (url.replace(password, "guess"), url.replace(f":{password}@", "")):
            connector = LMCacheConnector(torch.zeros(SHAPE, dtype=torch.bfloat16), fingerprint(), remote_url=wrong)
            with pytest.raises(KVTransferError, match="refused our credentials.*redis://:PASSWORD@HOST:PORT") as raised:
                asyncio.run(connector.start("127.0.0.1", 0))
            assert "guess" not in str(raised.value)
        assert LMCacheConnector(
            torch.zeros(SHAPE, dtype=torch.bfloat16), fingerprint(), remote_url=url
        ).shown_url == url.replace(password, "***")
        output = capfd.readouterr()
        assert password not in output.out + output.err
    finally:
        stop(process)


def test_configuration_errors_say_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
    monkeypatch.delenv("SPLITSERVE_LMCACHE_URL", raising=False)
    with pytest.raises(
        ValueError,
        match=r"set SPLITSERVE_LMCACHE_URL=redis://\[USER:PASSWORD@\]HOST:PORT, rediss://\.\.\. or lm://HOST:PORT",
    ):
        LMCacheConnector(cache, fingerprint())
    with pytest.raises(ValueError, match="chunk_size 24 must be a multiple of the block size 16"):
        LMCacheConnector(cache, fingerprint(), remote_url="redis://127.0.0.1:6379", chunk_size=24)
    monkeypatch.setenv("SPLITSERVE_LMCACHE_URL", "lm://127.0.0.1:65432")
    connector = make_connector("lmcache", cache, fingerprint())
    assert isinstance(connector, LMCacheConnector) and connector.remote_url == "lm://127.0.0.1:65432"
    assert connector.chunk_size == 256


def test_keys_tell_every_fingerprint_field_apart() -> None:
    base = fingerprint()
    names = {key_model_name(base)}
    for change in (
        {"dtype": "float16"},
        {"block_size": 32},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_dim": 16},
    ):
        names.add(key_model_name(type(base)(**{**{f: getattr(base, f) for f in base.__slots__}, **change})))
    assert len(names) == 6
    # Heads are stored apart: ranks of any tensor-parallel size read each other's keys.
    split = type(base)(**{**{f: getattr(base, f) for f in base.__slots__}, "tensor_parallel_size": 2})
    assert key_model_name(split) == key_model_name(base)
    # So does a D without Medusa heads read what a P with heads stored: the drafter crosses beside the KV.
    drafting = type(base)(**{**{f: getattr(base, f) for f in base.__slots__}, "draft": "medusa:heads-0123"})
    assert key_model_name(drafting) == key_model_name(base)
    odd = key_model_name(
        type(base)(**{**{f: getattr(base, f) for f in base.__slots__}, "model": "a@b%c d/" + "x" * 100})
    )
    assert "@" not in odd and "%" not in odd and " " not in odd and len(odd) <= 81


# ------------------------------------------------------------- the store is not trusted


def _publish_keys(client, store_key: bytes, salt: str, token: bytes) -> list[bytes]:
    """The Redis keys of one publish (every chunk's bytes and metadata, of every head), by its tags."""
    return sorted(
        key
        for head in range(SHAPE[4])
        for key in client.scan_iter(match=f"*@k%{key_tag(store_key, salt, token, head)}*")
    )


def test_bytes_the_store_returns_must_be_those_p_stored() -> None:
    """Someone who can write the store overwrites a real key of P's publish with bytes of their
    own (the same length, so LMCache takes them): D refuses the pull before writing anything.
    A handle without digests is refused too."""
    import redis

    process, url = start_redis()
    try:
        with prefill_peer(url):
            client = redis.Redis.from_url(url)
            keys = _publish_keys(client, b"", "", b"")
            assert len(keys) == 8  # 2 chunks of 2 heads, bytes and metadata each
            forged = next(key for key in keys if key.endswith(b"kv_bytes"))  # one of the two chunks
            genuine = client.get(forged)
            client.set(forged, bytes(b ^ 0x40 for b in genuine))
            local = torch.zeros(SHAPE, dtype=torch.bfloat16)
            with pytest.raises(
                KVTransferError, match=r"returned other bytes for tokens (0\.\.31|32\.\.59) \(KV head [01]\) of 'r'"
            ):
                pull(local, url, source(), [0, 3, 11, 6])
            assert not local.any(), "nothing written"
            with pytest.raises(
                KVTransferError, match="carries 0 chunk digests for the 2 chunks of 60 tokens of 2 KV heads"
            ):
                pull(local, url, source(digests=[]), [0, 3, 11, 6])
            client.set(forged, genuine)
            pull(local, url, source(), [0, 3, 11, 6])
            assert torch.equal(local[[0, 3, 11]], seeded_cache(7)[PUBLISHED_BLOCKS[:3]])
    finally:
        stop(process)


def test_keys_belong_to_one_publish_and_expire() -> None:
    """Each publish tags its keys with HMAC(store key, cache salt, pull token): the same prompt
    published twice, or under another salt, shares no key; a pull finds it only with the same
    store key, salt and token; every key P stored expires: after the TTL given, or, from a
    connector built as instances build theirs (no TTL given), after :data:`DEFAULT_TTL_S`."""
    import redis

    process, url = start_redis()
    store_key, token = bytes(range(32)), bytes(range(16))

    async def scenario() -> None:
        prefill = LMCacheConnector(seeded_cache(7), fingerprint(), remote_url=url, chunk_size=CHUNK_SIZE, ttl_s=300)
        as_instances = make_connector(
            "lmcache", seeded_cache(7), fingerprint(), {"remote_url": url, "chunk_size": CHUNK_SIZE}
        )
        decode_cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
        decode = LMCacheConnector(decode_cache, fingerprint(), remote_url=url, chunk_size=CHUNK_SIZE)
        prefill._store_key = decode._store_key = as_instances._store_key = store_key
        await prefill.start("127.0.0.1", 0)
        await as_instances.start("127.0.0.1", 0)
        await decode.start("127.0.0.1", 0)
        try:
            published = await prefill.publish("r", PUBLISHED_BLOCKS, PROMPT, pull_token=token, cache_salt="tenant-a")
            again = await prefill.publish("r2", PUBLISHED_BLOCKS, PROMPT, pull_token=token[::-1], cache_salt="tenant-a")
            await as_instances.publish("r3", PUBLISHED_BLOCKS, PROMPT, pull_token=token, cache_salt="tenant-b")
            assert published.chunk_digests == again.chunk_digests == tuple(DIGESTS or published.chunk_digests)
            client = redis.Redis.from_url(url)
            publishes = [("tenant-a", token), ("tenant-a", token[::-1]), ("tenant-b", token)]
            key_sets = [set(_publish_keys(client, store_key, salt, t)) for salt, t in publishes]
            assert [len(keys) for keys in key_sets] == [8, 8, 8] and len(set().union(*key_sets)) == 24
            # Redis's own countdown (-1: the key never expires): at most the TTL set, and the
            # default one's above the 300 s given to the other connector.
            given = [client.pttl(key) for keys in key_sets[:2] for key in keys]
            default = [client.pttl(key) for key in key_sets[2]]
            assert all(0 < ttl <= 300_000 for ttl in given), given
            assert all(300_000 < ttl <= DEFAULT_TTL_S * 1000 for ttl in default), default
            good = source(digests=list(published.chunk_digests), cache_salt="tenant-a", pull_token=token)
            for wrong in (
                source(digests=list(published.chunk_digests), cache_salt="tenant-c", pull_token=token),
                source(digests=list(published.chunk_digests), cache_salt="tenant-a", pull_token=bytes(16 * [1])),
            ):
                with pytest.raises(KVTransferError, match="has no KV for tokens 0..59"):
                    await decode.pull(wrong, [0, 3, 11, 6], 0, timeout_s=10.0)
            decode._store_key = store_key[::-1]  # another cluster secret
            with pytest.raises(KVTransferError, match="has no KV for tokens 0..59"):
                await decode.pull(good, [0, 3, 11, 6], 0, timeout_s=10.0)
            assert not decode_cache.any()
            decode._store_key = store_key
            await decode.pull(good, [0, 3, 11, 6], 0, timeout_s=10.0)
            assert torch.equal(decode_cache[[0, 3, 11]], seeded_cache(7)[PUBLISHED_BLOCKS[:3]])
        finally:
            await prefill.close()
            await as_instances.close()
            await decode.close()

    try:
        asyncio.run(scenario())
    finally:
        stop(process)


def test_chunk_hashes_in_keys_are_keyed_by_the_cluster_secret() -> None:
    """LMCache named a chunk by Python's unkeyed builtin ``hash`` chained over its tokens: anyone
    who can list the store's keys (a SCAN) could hash a prompt they guess and see whether it is
    cached (issue 42, item 7). Now HMAC-SHA256 under the KV store key: two clusters' keys for
    the same prompt share no chunk hash, and neither is the builtin one; a pull still finds P's."""
    import redis

    process, url = start_redis()
    token = bytes(range(16))

    def builtin_chain(tokens: list[int]) -> set[bytes]:
        parent, hashes = 0, set()
        for start in range(0, len(tokens), CHUNK_SIZE):
            parent = hash((parent, tuple(tokens[start : start + CHUNK_SIZE]), ()))
            hashes.add(f"{parent:x}".encode())
        return hashes

    async def scenario() -> None:
        client = redis.Redis.from_url(url)
        chunk_hashes = {}
        for store_key in (bytes(32), bytes(range(32))):
            prefill = LMCacheConnector(
                seeded_cache(7), fingerprint(), remote_url=url, chunk_size=CHUNK_SIZE, store_key=store_key
            )
            await prefill.start("127.0.0.1", 0)
            try:
                published = await prefill.publish("r", PUBLISHED_BLOCKS, PROMPT, pull_token=token)
            finally:
                await prefill.close()
            chunk_hashes[store_key] = {key.split(b"@")[3] for key in _publish_keys(client, store_key, "", token)}
            local = torch.zeros(SHAPE, dtype=torch.bfloat16)
            pulled = source(digests=list(published.chunk_digests), pull_token=token)
            await asyncio.to_thread(pull, local, url, pulled, [0, 3, 11, 6], store_key=store_key)
            assert torch.equal(local[[0, 3, 11]], seeded_cache(7)[PUBLISHED_BLOCKS[:3]])
        first, second = chunk_hashes.values()
        assert len(first) == len(second) == 2  # PROMPT's two chunks
        assert first.isdisjoint(second) and first.isdisjoint(builtin_chain(PROMPT)), (first, second)

    try:
        asyncio.run(scenario())
    finally:
        stop(process)


def test_a_slow_store_never_holds_up_the_event_loop(redis_url: str) -> None:
    """The store stops answering mid-publish: the event loop runs on (the publish waits on a
    worker thread), an unpublish of the request waits for the publish to stop copying the
    blocks, and both end once the store answers again."""

    async def scenario(url: str, proxy) -> None:
        prefill = LMCacheConnector(seeded_cache(7), fingerprint(), remote_url=url, chunk_size=CHUNK_SIZE)
        await prefill.start("127.0.0.1", 0)
        try:
            proxy.stall()
            publishing = asyncio.ensure_future(prefill.publish("slow", PUBLISHED_BLOCKS, PROMPT, pull_token=b"t"))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, proxy.holding.wait, 30.0)  # the loop ran meanwhile
            assert not publishing.done()
            unpublishing = asyncio.ensure_future(prefill.unpublish("slow"))
            for _ in range(3):
                await asyncio.sleep(0)
            assert not unpublishing.done() and not publishing.done()
            proxy.resume()
            published = await publishing
            await unpublishing
            assert len(published.chunk_digests) == 4
        finally:
            proxy.resume()
            await prefill.close()

    with stalling_proxy(redis_url) as (proxy, url):
        asyncio.run(scenario(url, proxy))


# ------------------------------------------------------------- tensor-parallel ranks


def _rank_cache(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s cache: its KV heads of ``full`` (engine/tensor_parallel/layout.py)."""
    from engine.tensor_parallel.layout import kv_head_range

    heads = kv_head_range(rank, size, full.shape[4])
    return full[:, :, :, :, heads.start : heads.stop].clone()


def _ranks(caches: list[torch.Tensor], url: str, size: int) -> list[LMCacheConnector]:
    split = dataclasses.replace(fingerprint(), tensor_parallel_size=size)
    return [
        LMCacheConnector(cache, split, remote_url=url, chunk_size=CHUNK_SIZE, tensor_parallel_rank=rank)
        for rank, cache in enumerate(caches)
    ]


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(2, 1), (1, 2), (4, 2), (1, 4)])
def test_ranks_of_any_size_store_and_fetch_exactly_their_heads(
    redis_url: str, prefill_size: int, decode_size: int
) -> None:
    """P's ranks store their heads (a replicated head once), their digests joined in rank order
    make the handle's; D's ranks each fetch exactly their heads: the blocks equal P's, and the
    bytes of all D's pulls together are the prompt's KV once per head D holds."""
    full = seeded_cache(11)
    prefill = _ranks([_rank_cache(full, r, prefill_size) for r in range(prefill_size)], redis_url, prefill_size)
    decode_caches = [torch.zeros_like(_rank_cache(full, r, decode_size)) for r in range(decode_size)]
    decode = _ranks(decode_caches, redis_url, decode_size)
    token = bytes(range(16))
    local_blocks = [0, 3, 11, 6]

    async def scenario() -> list[int]:
        for connector in prefill + decode:
            await connector.start("127.0.0.1", 0)
        try:
            published = await asyncio.gather(
                *(connector.publish("tp", PUBLISHED_BLOCKS, PROMPT, pull_token=token) for connector in prefill)
            )
            digests = tuple(digest for part in published for digest in part.chunk_digests)
            assert len(digests) == SHAPE[4] * 2  # every head's 2 chunks, once
            src = KVSource(
                "tp",
                "",
                tuple(PUBLISHED_BLOCKS),
                len(PROMPT),
                prefill[0].fingerprint,
                tuple(PROMPT),
                token,
                "",
                digests,
            )
            stats = await asyncio.gather(*(connector.pull(src, local_blocks, 0, 10.0) for connector in decode))
            return [s.num_bytes for s in stats]
        finally:
            for connector in prefill + decode:
                await connector.close()

    pulled = asyncio.run(scenario())
    for rank, cache in enumerate(decode_caches):
        assert torch.equal(cache[local_blocks[:3]], _rank_cache(full, rank, decode_size)[PUBLISHED_BLOCKS[:3]])
        tail = _rank_cache(full, rank, decode_size)[PUBLISHED_BLOCKS[3], :, :, :TAIL]
        assert torch.equal(cache[local_blocks[3], :, :, :TAIL], tail)
    bytes_per_head_token = SHAPE[1] * 2 * SHAPE[5] * 2  # layers, K and V, head_dim, bfloat16
    heads_held = [cache.shape[4] for cache in decode_caches]
    assert pulled == [heads * len(PROMPT) * bytes_per_head_token for heads in heads_held]


# ------------------------------------------------------------- pipeline stages


def _shaped(tensor_parallel_size: int, stage_first_layers: tuple[int, ...]):
    return dataclasses.replace(
        fingerprint(), tensor_parallel_size=tensor_parallel_size, stage_first_layers=stage_first_layers
    )


def _placed_ranks(full: torch.Tensor, url: str, split) -> list[LMCacheConnector]:
    """A connector per rank of ``split`` (stage-major), over its heads of its stage's layers of ``full``."""
    connectors = []
    for stage, layers in enumerate(split.layout.stage_layers()):
        for rank in range(split.tensor_parallel_size):
            cache = _rank_cache(full, rank, split.tensor_parallel_size)[:, layers.start : layers.stop].clone()
            connectors.append(
                LMCacheConnector(
                    cache,
                    split,
                    remote_url=url,
                    chunk_size=CHUNK_SIZE,
                    tensor_parallel_rank=rank,
                    pipeline_stage=stage,
                )
            )
    return connectors


@pytest.mark.parametrize(
    ("prefill_shape", "decode_shape"),
    [((1, (0, 1)), (1, (0, 1))), ((1, (0, 1)), (1, (0,))), ((2, (0, 1)), (1, (0,))), ((2, (0, 1)), (4, (0, 1)))],
    ids=["P-PP2-D-PP2", "P-PP2-D-PP1", "P-TP2xPP2-D-TP1", "P-TP2xPP2-D-TP4xPP2"],
)
def test_stage_ranks_store_and_fetch_exactly_their_layers(redis_url: str, prefill_shape, decode_shape) -> None:
    """Each P rank stores its heads of its stage's layers, the digests joined stage-major make
    the handle's; each D rank fetches its heads of the P stages its own is made of: its blocks
    equal P's, and the bytes it fetched are exactly its layers' and heads' KV of the prompt."""
    full = seeded_cache(13)
    prefill_split, decode_split = _shaped(*prefill_shape), _shaped(*decode_shape)
    prefill = _placed_ranks(full, redis_url, prefill_split)
    decode = _placed_ranks(torch.zeros_like(full), redis_url, decode_split)
    for connector in decode:
        connector.kv_cache.zero_()
    token = bytes(range(16, 32))
    local_blocks = [0, 3, 11, 6]

    async def scenario() -> list[int]:
        for connector in prefill + decode:
            await connector.start("127.0.0.1", 0)
        try:
            published = await asyncio.gather(
                *(connector.publish("pp", PUBLISHED_BLOCKS, PROMPT, pull_token=token) for connector in prefill)
            )
            digests = tuple(digest for part in published for digest in part.chunk_digests)
            assert len(digests) == prefill_split.layout.num_stages * SHAPE[4] * 2  # stages, heads, chunks
            src = KVSource(
                "pp", "", tuple(PUBLISHED_BLOCKS), len(PROMPT), prefill_split, tuple(PROMPT), token, "", digests
            )
            stats = await asyncio.gather(*(connector.pull(src, local_blocks, 0, 10.0) for connector in decode))
            return [s.num_bytes for s in stats]
        finally:
            for connector in prefill + decode:
                await connector.close()

    pulled = asyncio.run(scenario())
    expected = _placed_ranks(full, redis_url, decode_split)
    bytes_per_layer_head_token = 2 * SHAPE[5] * 2  # K and V, head_dim, bfloat16
    for connector, truth, num_bytes in zip(decode, expected, pulled, strict=True):
        cache, want = connector.kv_cache, truth.kv_cache
        assert torch.equal(cache[local_blocks[:3]], want[PUBLISHED_BLOCKS[:3]])
        assert torch.equal(cache[local_blocks[3], :, :, :TAIL], want[PUBLISHED_BLOCKS[3], :, :, :TAIL])
        assert num_bytes == cache.shape[1] * cache.shape[4] * len(PROMPT) * bytes_per_layer_head_token


def test_a_decode_stage_that_cuts_a_prefill_stage_is_refused_naming_both_shapes(redis_url: str) -> None:
    """P at PP 1 stored whole-model objects; a D stage holding layer 1 alone would fetch layer 0
    too: refused at pairing and before a pull, naming both shapes."""
    from kv_connector.fingerprint import FingerprintMismatchError

    decode = _placed_ranks(seeded_cache(13), redis_url, _shaped(1, (0, 1)))[1]
    with pytest.raises(FingerprintMismatchError) as refused:
        decode.check_pairing(fingerprint())
    assert "decode at TP 1 x PP 2 (stages from layers 0, 1)" in str(refused.value)
    assert "prefill at TP 1 x PP 1 (stages from layers 0)" in str(refused.value)
    with pytest.raises(KVTransferError, match="a decode stage starting at layer 1"):
        decode.check_source(source())  # before each pull too
    # The other way round pairs: P's two stages make D's one.
    _placed_ranks(seeded_cache(13), redis_url, _shaped(1, (0,)))[0].check_pairing(_shaped(1, (0, 1)))
