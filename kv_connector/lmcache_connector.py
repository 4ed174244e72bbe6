"""KV transfer through LMCache: P stores the prompt's KV in a remote LMCache store
(``redis://`` or LMCache's own ``lm://`` server), D retrieves it by the prompt's
token ids. P and D never talk to each other; both only reach the store.

How the pieces fit:

- **Chunks.** LMCache splits a token sequence into chunks of ``chunk_size`` tokens
  (a multiple of the engine's block size) and keys each chunk by a hash chained
  over all tokens up to its end, so a key names a whole prefix. The last chunk
  may be partial (``save_unfull_chunk``): every prompt token's KV is stored.
- **Adapter.** LMCache's own engine connectors expect vLLM's CUDA caches;
  :class:`~kv_connector.lmcache_adapter.PagedKVAdapter` moves tokens between this
  engine's paged cache and LMCache memory objects with plain torch indexing, so it
  works for CPU and GPU caches alike.
- **Heads.** Each chunk is stored one KV head per object (the head's index is in its key's
  tag), so the store's layout is the same whatever either side's tensor parallelism: a
  prefill rank stores the heads it holds (a head replicated on several ranks, by the first
  of them only), and a decode rank fetches exactly its own heads, whichever P rank stored
  them. No rank ever fetches a head it does not hold, and the bytes of a pull are the missing
  blocks' KV once (vLLM's LMCache integration keys whole ranks instead, so P and D must
  split alike).
- **Stages.** With pipeline parallelism a rank's cache holds its stage's layers alone: a
  prefill rank stores each of its heads with its stage's layers as one object (the layer range
  in the key's tag where P has more than one stage), and a decode rank fetches, for each of its
  heads, the objects of the prefill stages that make up its own stage (P's stages are in the
  handle's fingerprint). So a decode stage must be whole prefill stages: D's stage boundaries
  among P's (P at PP 2 to D at PP 1, or TP 2 x PP 2 to TP 1, or the same split), else the pair
  is refused at the Decode call naming both shapes (:func:`stage_pairing_error`), since a
  decode rank would fetch layers it does not hold. Objects per layer would lift that rule at
  the cost of a store object, a round trip and a handle digest per layer of every chunk.
- **Draft KV.** With an EAGLE draft on P, its KV over the prompt is one more object beside the
  chunks, under a key that also names the drafter, its digest in the handle beside theirs; D
  with a draft fetches it whole before the chunks it lacks (:mod:`kv_connector.lmcache_draft_kv`).
- **Fingerprint.** The key's model-name field is the model identity plus a digest
  of the :class:`Fingerprint` (all but the tensor-parallel size, which changes how KV is
  split, not what it is, and the drafter, which crosses beside the KV) and its dtype field
  the cache dtype: a D with another fingerprint computes other keys and can only miss,
  never read P's bytes. D also compares the handle's fingerprint with its own first, so
  the usual mismatch is refused naming both.

The store is configured with ``SPLITSERVE_LMCACHE_URL`` (or ``remote_url=``), the
same on P and D. lmcache's usage telemetry is switched off before it is imported.

Store access: a Redis store takes a password or an ACL user in the URL
(``redis://[USER:]PASSWORD@HOST:PORT``) and TLS with ``rediss://``; :meth:`start` checks
the store accepts them. The URL is shown only redacted (``cluster.store_urls.redact_url``): in
logs, errors, load reports and KV handles. lmcache logs the URLs it connects to at INFO,
so its log level defaults to WARNING here (``LMCACHE_LOG_LEVEL``).

The store is not trusted (docs/security.md):

- **Digests.** P records the SHA-256 of every chunk of every head as it stores it
  (:mod:`kv_connector.lmcache_adapter`); :meth:`publish` returns them, head by head, for the KV
  handle, which P signs. D digests every chunk it fetches and refuses the pull (a :class:`KVTransferError`,
  before anything is written to its blocks) unless each matches, and refuses a handle that
  carries none. Bytes someone else wrote under a real key never reach D's prefix cache.
- **Keys.** LMCache keys a chunk by a hash chained over the tokens up to its end; left to
  itself that hash is Python's unkeyed builtin ``hash`` of token tuples, which anyone who can
  list the store's keys could compute for a prompt they guess. Here it is HMAC-SHA256 under the
  KV store key (:meth:`LMCacheConnector._chunk_hash`, installed in LMCache's token database at
  start). Each publish also adds a tag of its own to its keys: HMAC-SHA256, under the KV
  store key derived from the cluster secret (``cluster/derived_keys.py``), of the request's
  cache salt, the handle's pull token (random per handle) and the head. No two publishes, and no two
  tenants, share a key (so one publish never overwrites another's chunks, whose bytes may
  differ in the last bits), and without the secret and the handle nobody can tell which keys
  hold a prompt's KV. A pull derives the same tag from the handle and the Decode call's salt.
- **Expiry.** On a Redis store every chunk P stored expires after ``ttl_s`` (a publish that
  the store confirms late, after P gave up, keeps none: the store's ``maxmemory-policy``
  bounds those). LMCache's ``lm://`` server has no expiry.

Threads: :meth:`publish` and :meth:`pull` run LMCache's blocking calls on worker threads, one
at a time (``LMCacheEngine`` is not documented thread-safe), so the event loop keeps answering
health, RenewKV and heartbeats while a slow store takes seconds; :meth:`unpublish` waits for a
publish of the same request still copying its blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import multiprocessing
import os
import re
import socket
import threading
import time
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar
from urllib.parse import urlsplit

# lmcache reports usage to its authors unless told not to; a server must not phone home.
os.environ["LMCACHE_TRACK_USAGE"] = "false"
# lmcache logs store URLs, passwords included, at INFO (module docstring).
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import redis
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from cluster.store_urls import redact_url, with_password_file
from engine.kv_cache_utils import cdiv
from engine.openmp_threads import serial_openmp
from engine.spec_decode.prompt_draft_kv import DraftKVShape, PromptDraftKV
from engine.tensor_parallel.layout import kv_head_range
from kv_connector.base import (
    KVConnector,
    KVSource,
    KVTransferError,
    PublishedKV,
    TransferStats,
    block_count_error,
    bounded_transfer,
)
from kv_connector.draft_kv import DraftKVCarrier
from kv_connector.fingerprint import BESIDE_KV_FIELDS, LAYOUT_FIELDS, Fingerprint, FingerprintMismatchError
from kv_connector.lmcache_adapter import PagedKVAdapter, write_blocks
from kv_connector.lmcache_draft_kv import (
    REMOTE_BACKEND,
    draft_kv_digest,
    draft_kv_key,
    fetch_draft_kv,
    is_stored,
    put_draft_kv,
    received_draft_kv,
)

logger = logging.getLogger(__name__)

URL_ENV = "SPLITSERVE_LMCACHE_URL"
SUPPORTED_SCHEMES = ("redis", "rediss", "lm")
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379}
_DEFAULT_CHUNK_TOKENS = 256  # lmcache's default; rounded to whole blocks
_MAX_DEFAULT_BUFFER_BYTES = 256 << 20
_REMOTE_OP_TIMEOUT_S = 10  # lmcache gives up on one remote get after this long
_PROBE_TIMEOUT_S = 1.0
_CLOSE_TIMEOUT_S = 10.0
DEFAULT_TTL_S = 600.0  # a hand-off is pulled within seconds; a handle queued longer is re-prefilled
_CHUNK_HASH_LABEL = b"splitserve lmcache chunk hash v1\0"  # apart from key_tag's messages, under the same key
_KEY_TAG = "lmcache.tag.k"  # LMCache appends a request's tags to its keys: "...@k%<tag>"
_KEY_TAG_BYTES = 12  # hex-encoded: 24 characters, within lm://'s 150-byte keys
_KV_STORE_SUFFIXES = ("kv_bytes", "metadata")  # lmcache's Redis connector: two Redis keys per chunk
_T = TypeVar("_T")


class LMCacheConnector(KVConnector, DraftKVCarrier):
    name = "lmcache"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: Fingerprint,
        *,
        remote_url: str | None = None,
        chunk_size: int | None = None,
        buffer_bytes: int | None = None,
        publish_timeout_s: float = 5.0,
        store_key: bytes | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        tensor_parallel_rank: int = 0,
        pipeline_stage: int = 0,
    ) -> None:
        """``chunk_size`` defaults to whole blocks near LMCache's 256 tokens; ``buffer_bytes``
        (host memory LMCache stages one transfer in, allocated up front) to the cache's
        size capped at 256 MiB — a prompt whose KV exceeds it is not stored. ``store_key``:
        the KV store key derived from the cluster secret (``cluster.derived_keys``), the same
        on P and D; None without a secret. ``ttl_s``: how long a Redis store keeps a chunk.
        ``tensor_parallel_rank``, ``pipeline_stage``: the rank whose cache this is (its KV heads
        and its stage's layers are that rank's)."""
        super().__init__(kv_cache, fingerprint)
        block_size = self.block_size
        if fingerprint.block_size != block_size:
            raise ValueError(
                f"fingerprint block_size {fingerprint.block_size} does not match the KV cache's {block_size}"
            )
        self.remote_url = with_password_file(remote_url or os.environ.get(URL_ENV, ""))
        self.shown_url = redact_url(self.remote_url)  # what logs, errors and handles may show
        if urlsplit(self.remote_url).scheme not in SUPPORTED_SCHEMES:
            raise ValueError(
                f"the lmcache KV connector needs the store P and D share, got {self.shown_url!r}: "
                f"set {URL_ENV}=redis://[USER:PASSWORD@]HOST:PORT, rediss://... or lm://HOST:PORT on both"
            )
        self.chunk_size = chunk_size or block_size * max(1, _DEFAULT_CHUNK_TOKENS // block_size)
        if self.chunk_size % block_size != 0:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of the block size {block_size}")
        self.publish_timeout_s = publish_timeout_s
        if ttl_s <= 0:
            raise ValueError(f"the LMCache chunks' TTL must be positive, got {ttl_s} s")
        self.ttl_s = ttl_s
        self._store_key = store_key or b""
        self._bytes_per_token = self.bytes_per_block // block_size
        size, num_kv_heads = fingerprint.tensor_parallel_size, fingerprint.num_kv_heads
        # The model's KV heads this cache holds, and those of them this rank stores when it
        # publishes: a head replicated on several ranks is stored by the first only.
        self.heads = kv_head_range(tensor_parallel_rank, size, num_kv_heads)
        if len(self.heads) != kv_cache.shape[4]:
            raise ValueError(
                f"rank {tensor_parallel_rank} of {size} holds KV heads {self.heads.start}..{self.heads.stop - 1} "
                f"of {num_kv_heads}, but its cache has {kv_cache.shape[4]} (bug)"
            )
        self.stored_heads = [
            head
            for head in self.heads
            if tensor_parallel_rank == min(r for r in range(size) if head in kv_head_range(r, size, num_kv_heads))
        ]
        self.stage = pipeline_stage
        self.layers = fingerprint.layout.stage_layers()[pipeline_stage]
        if len(self.layers) != kv_cache.shape[1]:
            raise ValueError(
                f"stage {pipeline_stage} holds layers {self.layers.start}..{self.layers.stop - 1} of "
                f"{fingerprint.num_layers}, but its cache has {kv_cache.shape[1]} (bug)"
            )
        cache_bytes = kv_cache.numel() * kv_cache.element_size()
        # Two spare chunks absorb the allocator's per-object alignment.
        self._buffer_bytes = (
            buffer_bytes or min(cache_bytes, _MAX_DEFAULT_BUFFER_BYTES) + 2 * self.chunk_size * self._bytes_per_token
        )
        self._adapter = PagedKVAdapter(kv_cache)
        self._instance_id = f"splitserve-{uuid.uuid4().hex[:12]}"
        self._engine: LMCacheEngine | None = None
        self._lock = threading.Lock()  # LMCacheEngine calls are not documented thread-safe
        self._publishing: dict[str, asyncio.Future[PublishedKV]] = {}  # P: stores still copying blocks
        self._redis: redis.Redis | None = None  # P, Redis stores: sets the chunks' TTL

    # ------------------------------------------------------------------ both

    async def start(self, host: str, port: int) -> str:
        """Build the LMCache engine and check the store answers (and, for Redis, accepts our
        credentials). Returns the store's URL, redacted (host and port are unused: nothing
        listens here). Raises :class:`KVTransferError` if the store is unreachable or refuses us."""
        error = await asyncio.to_thread(probe, self.remote_url, _PROBE_TIMEOUT_S)
        if error is None:
            error = await asyncio.to_thread(check_credentials, self.remote_url, _PROBE_TIMEOUT_S)
        if error is not None:
            raise KVTransferError(f"LMCache store {self.shown_url} is unreachable: {error}")
        self._engine = await asyncio.to_thread(run_on_daemon_thread, self._build_engine, None)
        logger.info(
            "LMCache KV connector on %s, chunks of %d tokens, keys for %s",
            self.shown_url,
            self.chunk_size,
            key_model_name(self.fingerprint),
        )
        return self.shown_url

    async def close(self) -> None:
        """Tear the engine down; with a Redis store it is only dropped (see below)."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if urlsplit(self.remote_url).scheme in ("redis", "rediss"):
            # lmcache 0.5.6's Redis connector deadlocks its own event loop on close. Its threads
            # were started as daemons (run_on_daemon_thread), so they end with the process.
            return
        try:
            await asyncio.to_thread(
                run_on_daemon_thread, lambda: LMCacheEngineBuilder.destroy(self._instance_id), _CLOSE_TIMEOUT_S
            )
        except TimeoutError:
            logger.warning(
                "LMCache engine %s did not close within %.0f s; leaving it to process exit",
                self._instance_id,
                _CLOSE_TIMEOUT_S,
            )

    # ------------------------------------------------------------- prefill side

    async def publish(
        self,
        request_id: str,
        block_ids: list[int],
        token_ids: list[int],
        pull_token: bytes | None = None,
        cache_salt: str = "",
    ) -> PublishedKV:
        """P, right after prefill: store the KV of ``token_ids`` (held in ``block_ids``, the
        last block possibly partial), each head this rank stores apart, under this publish's
        keys, on a worker thread, and wait until the store confirms every chunk (bounded by
        ``publish_timeout_s``), so a pull that follows finds it. Returns the chunks' digests
        for the handle, head by head (a chunk the store did not take has an empty one). A store failure is
        logged, not raised: the handle still goes out, and D's pull fails as a miss."""
        engine = self._started()
        tokens = [int(token) for token in token_ids]
        if (mismatch := block_count_error(len(block_ids), len(tokens), self.block_size)) is not None:
            raise RuntimeError(f"publishing {request_id!r}: {mismatch} (bug)")
        self.check_block_ids(block_ids)
        if not tokens:
            return PublishedKV()
        if request_id in self._publishing:
            raise RuntimeError(f"{request_id!r} is being published already (bug)")
        storing = asyncio.ensure_future(
            asyncio.to_thread(self._store, engine, request_id, list(block_ids), tokens, cache_salt, pull_token or b"")
        )
        self._publishing[request_id] = storing
        storing.add_done_callback(lambda _: self._publishing.pop(request_id, None))
        # Shielded: a caller that gives up (its call cancelled) unpublishes, which waits for the copy.
        return await asyncio.shield(storing)

    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
        """Waits for a publish of the request still copying its blocks; otherwise nothing to do:
        stored chunks outlive the request (a pull may be reading them) until their TTL, and P's
        blocks were copied at publish."""
        storing = self._publishing.get(request_id)
        if storing is not None:
            await asyncio.wait([storing])

    async def publish_draft_kv(
        self, request_id: str, draft_kv: PromptDraftKV, pull_token: bytes | None = None, cache_salt: str = ""
    ) -> bytes:
        """P, right after :meth:`publish`: store the draft KV beside the chunks, under this
        publish's key of the draft (kv_connector/lmcache_draft_kv.py), and return its digest for the
        handle once the store confirms it; empty (logged) where it did not, so D pulls the blocks alone."""
        engine = self._started()
        key = self._draft_kv_key(cache_salt, pull_token or b"", draft_kv.end, draft_kv.kv.dtype)
        return await asyncio.to_thread(self._store_draft_kv, engine, request_id, key, draft_kv)

    # -------------------------------------------------------------- decode side

    async def pull(
        self, source: KVSource, block_ids: list[int], num_local_hit_blocks: int, timeout_s: float
    ) -> TransferStats:
        """D: retrieve this rank's heads of its stage's layers of the KV of ``source.token_ids``
        from the store (under the keys of P's publish: its pull token, the call's cache salt and
        the P stages that make up this rank's), check each
        chunk against the handle's digests, and write blocks ``num_local_hit_blocks:`` of it into
        ``block_ids[num_local_hit_blocks:]``; earlier blocks (D's own prefix-cache hits) are not
        touched. Raises :class:`KVTransferError` on a fingerprint mismatch, a handle without
        a digest per chunk, a miss (not stored, evicted, stored under another fingerprint or
        salt), a chunk whose bytes are not the ones P stored, an unreachable store or the
        timeout; D's blocks are then untouched."""
        engine = self._started()
        tokens = [int(token) for token in source.token_ids]
        block_size = self.block_size
        if not tokens:
            raise KVTransferError(
                f"no prompt token ids for {source.request_id!r}; the lmcache connector retrieves by tokens"
            )
        if len(tokens) != source.num_tokens:
            raise KVTransferError(
                f"{len(tokens)} prompt token ids for the KV of {source.num_tokens} tokens of {source.request_id!r} "
                "(bug)"
            )
        if (mismatch := block_count_error(len(block_ids), len(tokens), block_size)) is not None:
            raise KVTransferError(f"local blocks of {source.request_id!r}: {mismatch} (bug)")
        num_blocks = len(block_ids)
        if not 0 <= num_local_hit_blocks <= num_blocks:
            raise KVTransferError(
                f"{num_local_hit_blocks} local hit blocks outside the prompt's {num_blocks} blocks (bug)"
            )
        if num_local_hit_blocks == num_blocks:
            return TransferStats(num_blocks=0, num_bytes=0, seconds=0.0)
        self.check_source(source)
        num_chunks = cdiv(len(tokens), self.chunk_size)
        num_kv_heads = self.fingerprint.num_kv_heads
        source_stages = source.fingerprint.layout.stage_layers()
        if len(source.chunk_digests) != len(source_stages) * num_kv_heads * num_chunks:
            raise KVTransferError(
                f"the KV handle of {source.request_id!r} carries {len(source.chunk_digests)} chunk digests for the "
                f"{num_chunks} chunks of {len(tokens)} tokens of {num_kv_heads} KV heads in {len(source_stages)} "
                "stages: the store's bytes cannot be checked (a prefill instance that does not digest them, or "
                "another --lmcache chunk size)"
            )
        # What this rank fetches: each of its heads of each prefill stage inside its own stage.
        objects = [
            _StoredObject(stage, layers, head, tagged_layers(len(source_stages), layers))
            for stage, layers in enumerate(source_stages)
            if layers.start in self.layers
            for head in self.heads
        ]
        started = time.perf_counter()
        first_token = num_local_hit_blocks * block_size
        # LMCache skips only whole chunks; the chunk holding first_token is fetched whole.
        fetch_start = first_token - first_token % self.chunk_size
        staging = torch.empty(
            self._adapter.staging_shape(len(tokens) - fetch_start),
            dtype=self.kv_cache.dtype,
            device=self.kv_cache.device,
        )
        # Per object fetched: chunk start -> digest of the bytes the store returned.
        fetched: list[dict[int, bytes]] = [{} for _ in objects]
        retrieved = await bounded_transfer(
            asyncio.to_thread(self._retrieve, engine, tokens, fetch_start, staging, source, objects, fetched),
            timeout_s,
            f"retrieving {source.request_id!r} from LMCache at {self.shown_url}",
        )
        for stored, hits, digests in zip(objects, retrieved, fetched, strict=False):
            missing = (~hits[fetch_start:]).nonzero()
            if len(missing):
                raise await self._miss(source, fetch_start + int(missing[0]), len(tokens), stored)
            first_digest = (stored.stage * num_kv_heads + stored.head) * num_chunks
            for start in range(fetch_start, len(tokens), self.chunk_size):
                digest = digests.get(start)
                expected = source.chunk_digests[first_digest + start // self.chunk_size]
                if digest is None or not hmac.compare_digest(digest, expected):
                    raise KVTransferError(
                        f"LMCache at {self.shown_url} returned other bytes for tokens {start}.."
                        f"{min(start + self.chunk_size, len(tokens)) - 1} ({stored.describe()}) of "
                        f"{source.request_id!r} than the prefill instance stored (their digest is not the KV "
                        "handle's): refused, nothing written"
                    )
        write_blocks(self.kv_cache, block_ids, first_token, len(tokens), staging[:, :, first_token - fetch_start :])
        return TransferStats(
            num_blocks=num_blocks - num_local_hit_blocks,
            num_bytes=staging.numel() * staging.element_size(),
            seconds=time.perf_counter() - started,
            num_messages=len(objects) * cdiv(len(tokens) - fetch_start, self.chunk_size),
        )

    async def pull_with_draft_kv(
        self,
        source: KVSource,
        block_ids: list[int],
        num_local_hit_blocks: int,
        timeout_s: float,
        draft_shape: DraftKVShape,
    ) -> tuple[TransferStats, PromptDraftKV | None]:
        """D: the draft KV the handle vouches for (whole, whatever D's prefix-cache hits: D caches
        none), fetched and checked before :meth:`pull` writes a block; then the pull. A handle
        without a draft digest (P stored none): the pull alone. Raises :class:`KVTransferError`
        where the store misses the draft KV or returns another span, shape or bytes than P stored."""
        if not source.draft_kv_digest:
            return await self.pull(source, block_ids, num_local_hit_blocks, timeout_s), None
        self.check_source(source)
        engine = self._started()
        started = time.perf_counter()
        key = self._draft_kv_key(source.cache_salt, source.pull_token, source.num_tokens, draft_shape.dtype)
        what = f"draft KV of {source.request_id!r}"
        fetched = await bounded_transfer(
            asyncio.to_thread(self._fetch_draft_kv, engine, key), timeout_s, f"retrieving the {what} from LMCache"
        )
        if fetched is None:
            error = await asyncio.to_thread(probe, self.remote_url, _PROBE_TIMEOUT_S)
            if error is not None:
                raise KVTransferError(f"LMCache store {self.shown_url} is unreachable: {error}")
            raise KVTransferError(
                f"LMCache at {self.shown_url} has no {what} under {key_model_name(self.fingerprint)}: not stored, "
                "expired, evicted, or stored for another draft, cache salt or KV handle"
            )
        try:
            draft_kv = received_draft_kv(fetched, source.num_tokens, draft_shape, source.draft_kv_digest)
        except KVTransferError as error:
            raise KVTransferError(f"LMCache at {self.shown_url} returned {error} as the {what}: refused") from None
        remaining_s = timeout_s - (time.perf_counter() - started)
        stats = await self.pull(source, block_ids, num_local_hit_blocks, remaining_s)
        return (
            TransferStats(
                num_blocks=stats.num_blocks,
                num_bytes=stats.num_bytes + draft_kv.kv.nbytes,
                seconds=time.perf_counter() - started,
                num_messages=stats.num_messages + 1,
            ),
            draft_kv,
        )

    def check_pairing(self, prefill: Fingerprint) -> None:
        """The fingerprint's rule, and the store's: each decode stage must be whole prefill
        stages (module docstring, "Stages")."""
        super().check_pairing(prefill)
        if (error := stage_pairing_error(prefill, self.fingerprint)) is not None:
            raise FingerprintMismatchError(error)

    # -------------------------------------------------------------- internals

    def _build_engine(self) -> LMCacheEngine:
        _, layers, _, _, _, head_dim = self.kv_cache.shape
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.chunk_size,
            local_cpu=False,  # no local hot cache: the remote store is the hand-off
            max_local_cpu_size=self._buffer_bytes / 1024**3,
            remote_url=self.remote_url,
            remote_serde="naive",
            save_unfull_chunk=True,  # the prompt's partial last block travels too
            blocking_timeout_secs=_REMOTE_OP_TIMEOUT_S,
        )
        metadata = LMCacheMetadata(
            model_name=key_model_name(self.fingerprint),
            # One head per object, the same whatever the tensor parallelism ("Heads" above).
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=self.kv_cache.dtype,
            kv_shape=(layers, 2, self.chunk_size, 1, head_dim),
            chunk_size=self.chunk_size,
        )
        # LMCacheEngine forces the "spawn" start method process-wide; keep this process's choice.
        start_method = multiprocessing.get_start_method(allow_none=True)
        try:
            engine = LMCacheEngineBuilder.get_or_create(
                self._instance_id, config, metadata, self._adapter, _single_rank, _single_rank
            )
            # Before any key is made: P and D must chain chunk hashes alike (both hold the key).
            engine.token_database.hash_func = self._chunk_hash
            engine.post_init()
        finally:
            multiprocessing.set_start_method(start_method, force=True)
        return engine

    def _chunk_hash(self, chunk: tuple[int, tuple[int, ...], tuple[object, ...]]) -> bytes:
        """LMCache's chunk hash (its token database calls it with the parent chunk's hash, the
        chunk's token ids and extra keys, none here): HMAC-SHA256 under the KV store key, of which
        LMCache keeps the first 8 bytes. Read at each call, so a connector given another key
        (a test's other cluster) hashes with it."""
        parent_hash, token_ids, extra_keys = chunk
        message = b"".join(
            (
                _CHUNK_HASH_LABEL,
                (parent_hash % (1 << 64)).to_bytes(8, "little"),
                array("q", token_ids).tobytes(),
                repr(extra_keys).encode() if extra_keys else b"",
            )
        )
        return hmac.new(self._store_key, message, hashlib.sha256).digest()

    def _started(self) -> LMCacheEngine:
        if self._engine is None:
            raise RuntimeError("the lmcache KV connector was used before start() or after close() (bug)")
        return self._engine

    def _request_configs(self, cache_salt: str, pull_token: bytes, head: int, layers: range | None) -> dict[str, str]:
        """LMCache's request configs that tag one publish's keys of one head (of one stage's
        ``layers``; None: all): P and D derive the same."""
        return {_KEY_TAG: key_tag(self._store_key, cache_salt, pull_token, head, layers)}

    def _store(
        self,
        engine: LMCacheEngine,
        request_id: str,
        block_ids: list[int],
        tokens: list[int],
        cache_salt: str,
        pull_token: bytes,
    ) -> PublishedKV:
        """Worker thread: :meth:`publish`'s store of each head, its confirmation and the chunks' expiry."""
        serial_openmp()  # the copies out of the cache start no OpenMP team beside the step thread's
        chunk_digests: list[bytes] = []
        deadline = time.monotonic() + self.publish_timeout_s
        layers = tagged_layers(self.fingerprint.layout.num_stages, self.layers)
        for head in self.stored_heads:
            configs = self._request_configs(cache_salt, pull_token, head, layers)
            digests: dict[int, bytes] = {}  # chunk start -> digest, filled by the adapter as it copies
            try:
                with self._lock:
                    engine.store(
                        tokens,
                        block_ids=block_ids,
                        head=head - self.heads.start,
                        req_id=request_id,
                        request_configs=configs,
                        chunk_digests=digests,
                    )
                num_stored, reason = self._wait_until_stored(engine, tokens, configs, deadline)
                if num_stored >= len(tokens):
                    self._expire(engine, tokens, configs)
            except Exception:  # the request must still get its handle and lease (see publish)
                logger.exception("storing the KV of %s in LMCache at %s failed", request_id, self.shown_url)
                num_stored, reason = 0, "failed"
            if num_stored < len(tokens):
                logger.error(
                    "LMCache stored KV head %d (layers %d..%d) of %d of %d prompt tokens of %s in %s (%s); decode "
                    "instances will miss it",
                    head,
                    self.layers.start,
                    self.layers.stop - 1,
                    num_stored,
                    len(tokens),
                    request_id,
                    self.shown_url,
                    reason,
                )
            # A chunk LMCache did not store (no room) has no digest: D misses it anyway.
            chunk_digests.extend(digests.get(start, b"") for start in range(0, len(tokens), self.chunk_size))
        return PublishedKV(chunk_digests=tuple(chunk_digests))

    def _expire(self, engine: LMCacheEngine, tokens: list[int], configs: dict[str, str]) -> None:
        """Worker thread, Redis stores: give every chunk this publish stored its TTL."""
        keys = engine.token_database.process_tokens(tokens, request_configs=configs)
        self._set_ttl([key.to_string() for _, _, key in keys])

    def _set_ttl(self, keys: list[str]) -> None:
        """Worker thread, Redis stores: give the objects stored under ``keys`` (LMCache's key
        strings) the chunks' TTL."""
        if urlsplit(self.remote_url).scheme not in ("redis", "rediss"):
            return  # lm:// keeps chunks until its own eviction
        if self._redis is None:
            self._redis = redis.Redis.from_url(
                self.remote_url, socket_timeout=_PROBE_TIMEOUT_S, socket_connect_timeout=_PROBE_TIMEOUT_S
            )
        ttl_ms = int(self.ttl_s * 1000)
        with self._redis.pipeline(transaction=False) as pipeline:
            for key in keys:
                for suffix in _KV_STORE_SUFFIXES:
                    pipeline.pexpire(key + suffix, ttl_ms)
            try:
                pipeline.execute()
            except (redis.RedisError, OSError) as error:
                logger.warning("could not set the TTL of stored KV chunks in %s: %s", self.shown_url, error)

    def _wait_until_stored(
        self, engine: LMCacheEngine, tokens: list[int], configs: dict[str, str], deadline: float
    ) -> tuple[int, str]:
        """Poll the store until it holds every chunk. Returns (tokens stored, why not all)."""

        def num_stored() -> int:
            with self._lock:
                return engine.lookup(tokens, search_range=[REMOTE_BACKEND], request_configs=configs)

        return self._poll_store(num_stored, len(tokens), deadline)

    def _poll_store(self, count: Callable[[], int], wanted: int, deadline: float) -> tuple[int, str]:
        """Poll ``count`` until it reaches ``wanted``: lmcache writes in the background and Redis
        may answer a lookup before the write lands. Returns (the last count, why not all)."""
        delay_s, probed = 0.001, False
        started = time.monotonic()
        while True:
            if (counted := count()) >= wanted:
                return counted, ""
            if time.monotonic() >= deadline:
                return counted, f"not confirmed within {self.publish_timeout_s} s"
            if not probed and time.monotonic() - started > 0.05:  # slow: is the store there at all?
                probed, error = True, probe(self.remote_url, _PROBE_TIMEOUT_S)
                if error is not None:
                    return counted, f"store unreachable: {error}"
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.05)

    def _draft_kv_key(self, cache_salt: str, pull_token: bytes, num_tokens: int, dtype: torch.dtype) -> CacheEngineKey:
        return draft_kv_store_key(self.fingerprint, self._store_key, cache_salt, pull_token, num_tokens, dtype)

    def _store_draft_kv(
        self, engine: LMCacheEngine, request_id: str, key: CacheEngineKey, draft_kv: PromptDraftKV
    ) -> bytes:
        """Worker thread: :meth:`publish_draft_kv`'s store, its confirmation and its expiry."""
        serial_openmp()
        deadline = time.monotonic() + self.publish_timeout_s

        def num_stored() -> int:
            with self._lock:
                return int(is_stored(engine, key))

        try:
            with self._lock:
                staged = put_draft_kv(engine, key, draft_kv)
            reason = self._poll_store(num_stored, 1, deadline)[1] if staged else "no room to stage it"
        except Exception:  # the request must still get its handle (see publish)
            logger.exception("storing the draft KV of %s in LMCache at %s failed", request_id, self.shown_url)
            reason = "failed"
        if reason:
            logger.error(
                "LMCache did not store the draft KV of %s in %s (%s); decode instances pull its blocks alone and "
                "draft without it",
                request_id,
                self.shown_url,
                reason,
            )
            return b""
        self._set_ttl([key.to_string()])
        return draft_kv_digest(draft_kv)

    def _fetch_draft_kv(self, engine: LMCacheEngine, key: CacheEngineKey) -> torch.Tensor | None:
        """Worker thread: :func:`fetch_draft_kv`, one LMCache call at a time."""
        serial_openmp()
        with self._lock:
            return fetch_draft_kv(engine, key)

    def _retrieve(
        self,
        engine: LMCacheEngine,
        tokens: list[int],
        fetch_start: int,
        staging: torch.Tensor,
        source: KVSource,
        objects: list[_StoredObject],
        digests: list[dict[int, bytes]],
    ) -> list[torch.Tensor]:
        """Worker thread: fill ``staging`` from token ``fetch_start`` on, object by object
        (a head of a prefill stage's layers), and ``digests[i]`` with each chunk of
        ``objects[i]`` fetched. Returns LMCache's per-token hit mask of each object fetched
        (bool, on CPU); it stops at the first miss."""
        serial_openmp()  # the copies into the staging tensor start no OpenMP team beside the step thread's
        mask = None
        if fetch_start:
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[:fetch_start] = False  # a local prefix hit on D: not fetched
        hits = []
        for stored, chunk_digests in zip(objects, digests, strict=True):
            configs = self._request_configs(source.cache_salt, source.pull_token, stored.head, stored.tagged_layers)
            with self._lock:
                hits.append(
                    engine.retrieve(
                        tokens,
                        mask=mask,
                        staging=staging,
                        staging_start=fetch_start,
                        head=stored.head - self.heads.start,
                        layer_start=stored.layers.start - self.layers.start,
                        num_layers=len(stored.layers),
                        req_id=source.request_id,
                        request_configs=configs,
                        chunk_digests=chunk_digests,
                    )
                )
            if not hits[-1][fetch_start:].all():
                break  # a miss: the pull fails on it, the other objects need not be fetched
        return hits

    async def _miss(
        self, source: KVSource, first_missing: int, num_tokens: int, stored: _StoredObject
    ) -> KVTransferError:
        error = await asyncio.to_thread(probe, self.remote_url, _PROBE_TIMEOUT_S)
        if error is not None:
            return KVTransferError(f"LMCache store {self.shown_url} is unreachable: {error}")
        where = (
            self.shown_url
            if source.address in ("", self.shown_url)
            else f"{self.shown_url} (prefill stored to {source.address})"
        )
        return KVTransferError(
            f"LMCache at {where} has no KV for tokens {first_missing}..{num_tokens - 1} ({stored.describe()}) of "
            f"{source.request_id!r} "
            f"under {key_model_name(self.fingerprint)}: not stored, expired, evicted, or stored for another "
            "fingerprint, cache salt or KV handle"
        )


# ------------------------------------------------------------------ helpers


@dataclass(frozen=True, slots=True)
class _StoredObject:
    """What one retrieve fetches: KV head ``head`` of prefill stage ``stage``'s ``layers``
    (model layers), every chunk; ``tagged_layers`` is what its keys' tag names of the layers."""

    stage: int
    layers: range
    head: int
    tagged_layers: range | None

    def describe(self) -> str:
        if self.tagged_layers is None:
            return f"KV head {self.head}"
        return f"KV head {self.head}, layers {self.layers.start}..{self.layers.stop - 1}"


def tagged_layers(num_stages: int, layers: range) -> range | None:
    """What a prefill stage's keys' tag names of its ``layers``: nothing for a P of one stage
    (it holds every layer), so its keys are those of a P without pipeline stages."""
    return layers if num_stages > 1 else None


def stage_pairing_error(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """Why a decode instance cannot read what a prefill instance of another pipeline split
    stored (module docstring, "Stages"), naming both shapes; None where every decode stage is
    whole prefill stages."""
    cuts = sorted(set(decode.stage_first_layers) - set(prefill.stage_first_layers))
    if not cuts:
        return None
    return (
        f"KV caches are incompatible through LMCache, refusing to pair decode at {decode.layout.describe()} with "
        f"prefill at {prefill.layout.describe()}: the store holds each prefill stage's layers as one object per KV "
        f"head, and a decode stage starting at layer {', '.join(map(str, cuts))} would fetch layers it does not "
        "hold; split decode along prefill's stage boundaries (or at pipeline parallel size 1), or use "
        "--kv-connector ucx"
    )


def key_model_name(fingerprint: Fingerprint) -> str:
    """The model-name field of this instance's LMCache keys: readable model identity plus a
    digest of every fingerprint field but the tensor-parallel layout (each head is stored
    apart, so ranks of any size read each other's) and the drafter (a D without Medusa heads
    reads what a P with heads stored). Kept short (lm:// keys hold 150 bytes) and free of the
    ``@`` and ``%`` LMCache uses as key separators."""
    identity = [
        getattr(fingerprint, f.name) for f in fields(fingerprint) if f.name not in LAYOUT_FIELDS | BESIDE_KV_FIELDS
    ]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', fingerprint.model)[:64]}~{digest}"


def draft_kv_store_key(
    fingerprint: Fingerprint, store_key: bytes, cache_salt: str, pull_token: bytes, num_tokens: int, dtype: torch.dtype
) -> CacheEngineKey:
    """The key of one publish's draft KV for a prompt of ``num_tokens``, for the drafter
    ``fingerprint`` names (kv_connector/lmcache_draft_kv.py): P and D derive the same."""
    model_name = key_model_name(fingerprint)
    return draft_kv_key(model_name, _KEY_TAG, store_key, cache_salt, pull_token, fingerprint.draft, num_tokens, dtype)


def key_tag(store_key: bytes, cache_salt: str, pull_token: bytes, head: int, layers: range | None = None) -> str:
    """The tag of one publish's store keys of one KV head (module docstring), hex: HMAC-SHA256
    under the KV store key of the request's cache salt, the handle's pull token and the head
    (and the prefill stage's ``layers``, where P has stages: :func:`tagged_layers`), each
    length-prefixed. LMCache writes it into every key of the publish as ``@k%<tag>``."""
    parts: tuple[bytes, ...] = (cache_salt.encode(), pull_token, str(head).encode())
    if layers is not None:
        parts += (f"{layers.start}:{layers.stop}".encode(),)
    message = b"".join(len(part).to_bytes(8, "little") + part for part in parts)
    return hmac.new(store_key, message, hashlib.sha256).digest()[:_KEY_TAG_BYTES].hex()


def probe(url: str, timeout_s: float) -> str | None:
    """Open and close a TCP connection to the store. Returns None if it answers, else why not."""
    parts = urlsplit(url)
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
        if parts.hostname is None or port is None:
            return f"{redact_url(url)!r} names no host and port"
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return None
    except (OSError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def check_credentials(url: str, timeout_s: float) -> str | None:
    """For a Redis store: PING with the URL's credentials (and TLS for ``rediss://``). Returns
    None if the store accepts them, else why not, with the fix for a refused password."""
    if urlsplit(url).scheme not in ("redis", "rediss"):
        return None  # lm:// has no credentials
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as error:
        return (
            f"it refused our credentials ({error}): put the store's password in the URL, "
            "redis://:PASSWORD@HOST:PORT (or USER:PASSWORD for an ACL user)"
        )
    except (redis.RedisError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        client.close()
    return None


def run_on_daemon_thread(function: Callable[[], _T], timeout_s: float | None) -> _T:
    """Run ``function`` on a fresh daemon thread and return its result. Threads it starts
    inherit daemon=True, so lmcache's event-loop thread can never keep the process alive.
    Raises TimeoutError if it has not finished after ``timeout_s``."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(function())
        except BaseException as error:  # re-raised on the calling thread
            outcome.append(error)

    thread = threading.Thread(target=target, name="lmcache-setup", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(function, '__name__', 'call')} still running after {timeout_s} s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]  # type: ignore[return-value]


def _single_rank(*_: object) -> None:
    raise RuntimeError("the lmcache KV connector is single-rank; LMCache asked for a tensor-parallel broadcast (bug)")
