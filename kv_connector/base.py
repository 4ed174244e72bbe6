"""The KV connector contract: how a prompt's KV blocks travel from a prefill engine
(P) to a decode engine (D).

Both sides hold their engine's KV cache tensor, block-major
(engine/kv_cache_layout.py): ``[num_blocks, num_layers, 2 (K, V), block_size,
num_kv_heads, head_dim]``, so block ``b`` is the contiguous ``kv_cache[b]``. A
transfer names blocks by id on each side, never raw offsets chosen by the peer.

Ownership: P's blocks are pinned by P's engine from the end of prefill until
D confirms the pull (ReleaseKV), the request is aborted, or its lease expires;
the connector reads them only between :meth:`KVConnector.publish` and the end of
:meth:`KVConnector.unpublish`, which returns once no transfer reads them any more
(a publish still copying them included). D's destination blocks are allocated by D's
engine, written only by :meth:`KVConnector.pull`, and not shared with any other
request until the engine is told the pull finished.

Threads: every method is called on the instance's event loop, which also answers health,
RenewKV, ReleaseKV and registry heartbeats; a method that blocks (copies, a store's round
trips) does that work on a worker thread and awaits it, never on the loop.

What P's publish returns (:class:`PublishedKV`) travels in the signed KV handle to D, and
back to the connector in :class:`KVSource`: a backend that keeps KV in a shared store
(lmcache) returns the digest of every chunk it stored, and D's pull refuses bytes the store
returns with another digest, so that nothing the store holds is believed without proof.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from engine.kv_cache_utils import cdiv
from kv_connector.fingerprint import Fingerprint, FingerprintMismatchError

T = TypeVar("T")


class KVTransferError(RuntimeError):
    """A pull failed (peer unreachable, refused, timed out, or sent something invalid).
    The decode side then recomputes the prompt or fails the request, as configured."""


@dataclass(frozen=True, slots=True)
class KVSource:
    """Where a request's prompt KV waits on the prefill side (the connector's view of a KVHandle
    and the Decode call's prompt)."""

    request_id: str
    address: str  # P's connector endpoint, host:port
    block_ids: tuple[int, ...]  # P's blocks, in prompt order
    num_tokens: int
    fingerprint: Fingerprint
    # The prompt's token ids, for backends that find KV by content (LMCache) rather than by P's block ids.
    token_ids: tuple[int, ...] = ()
    # What P asked pulls of these blocks to present (its ``publish(pull_token=...)``); empty: none.
    pull_token: bytes = field(default=b"", repr=False)
    # The request's prefix-cache salt (the Decode call's; P published under the same): a store
    # namespaces its keys by it.
    cache_salt: str = ""
    # What P's publish returned (:class:`PublishedKV`), from the signed handle.
    chunk_digests: tuple[bytes, ...] = field(default=(), repr=False)
    # Tensor parallelism: every P rank's endpoint, in rank order (empty at size 1: ``address``).
    rank_addresses: tuple[str, ...] = ()
    # Store backends: SHA-256 of the EAGLE draft's KV over the prompt P stored beside the chunks
    # (kv_connector/draft_kv.py), from the signed handle; empty: P stored none.
    draft_kv_digest: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class PublishedKV:
    """What a publish adds to the request's KV handle, for D's pull to check."""

    # Backends that keep the KV in a shared store: SHA-256 of each chunk's bytes as P stored
    # them, KV head by head and in prompt order within a head. Empty for backends that send
    # from P's own blocks.
    chunk_digests: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class TransferStats:
    num_blocks: int
    num_bytes: int
    seconds: float
    # Transport messages the pull took (UCX: one per span of blocks consecutive on both
    # sides; LMCache: chunks fetched). Many per block means a fragmented cache.
    num_messages: int = 0


class KVConnector(abc.ABC):
    """One backend's way of moving KV blocks. Subclasses are chosen by :attr:`name`."""

    name: str

    def __init__(self, kv_cache: torch.Tensor, fingerprint: Fingerprint) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2 or not kv_cache.is_contiguous():
            raise ValueError(
                "kv_cache must be a contiguous [blocks, layers, 2, block_size, kv_heads, head_dim], got "
                f"{tuple(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache
        self.fingerprint = fingerprint
        # Bytes of one block across all layers, K and V: one contiguous ``kv_cache[b]``.
        self.bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()
        # P: pulls still reading a request's blocks when :meth:`unpublish` cut them off. Zero
        # on a healthy cluster: D releases only after its pull, and renews the lease before.
        self.num_pulls_cut_off = 0

    @property
    def num_transfers_in_flight(self) -> int:
        """Pulls this side is serving (P) or making (D) right now; 0 where the backend keeps
        no count of its own. Reported in the load report (``kv_transfers_in_flight``)."""
        return 0

    @property
    def num_connections(self) -> int:
        """Connections to peers held open now (P: from decode instances; D: kept for the next
        pull); 0 for a backend that holds none. Reported as ``kv_connections``."""
        return 0

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[3]

    def check_block_ids(self, block_ids: list[int]) -> None:
        """Refuse ids outside this side's cache (a bug in the caller: ids come from the engine)."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise RuntimeError(
                f"block ids {min(block_ids)}..{max(block_ids)} outside a cache of {self.num_blocks} blocks (bug)"
            )

    # ------------------------------------------------------------- prefill side

    @abc.abstractmethod
    async def start(self, host: str, port: int) -> str:
        """Called once when the instance starts. P listens for pulls; D prepares its client side.
        Returns the address peers should use (P) or an empty string (D)."""

    @abc.abstractmethod
    async def publish(
        self,
        request_id: str,
        block_ids: list[int],
        token_ids: list[int],
        pull_token: bytes | None = None,
        cache_salt: str = "",
    ) -> PublishedKV:
        """P, right after prefill, while the engine keeps ``block_ids`` pinned: make the
        prompt KV they hold (``token_ids``' KV) available to pulls for ``request_id``, and
        return once a pull can find it, with what the KV handle must carry for the pull to
        check it. Blocking work runs off the event loop (module docstring). A caller that
        unpins the blocks while a publish runs (an abort) calls :meth:`unpublish`, which
        waits for the publish to stop reading them.

        ``pull_token``: random bytes a pull must present (backends whose peers reach P:
        compared in constant time; a store's backend derives its keys from them). The prefill
        service makes one per request and puts it in the signed KV handle; None lets any pull
        that names the request through, for tools that publish in-process (benchmarks,
        connector tests). ``cache_salt``: the request's prefix-cache salt."""

    @abc.abstractmethod
    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
        """P, before the engine unpins the request's blocks (release, abort or lease expiry):
        refuse further pulls of them, and return once no transfer reads them any more (nor a
        publish still copying them). A pull in progress gets ``grace_s`` to finish, then is cut
        off. A release passes a grace: D releases once its pull is over, which P may not have
        seen yet. Idempotent."""

    # -------------------------------------------------------------- decode side

    @abc.abstractmethod
    async def pull(
        self, source: KVSource, block_ids: list[int], num_local_hit_blocks: int, timeout_s: float
    ) -> TransferStats:
        """D: copy the KV of ``source.block_ids[num_local_hit_blocks:]`` into its own
        ``block_ids[num_local_hit_blocks:]`` (the blocks before are hits in D's own prefix
        cache, already holding that KV: not pulled). Raises
        :class:`KVTransferError` on any failure, including a fingerprint mismatch, the timeout,
        or (store backends) bytes that do not match ``source.chunk_digests``; on error the
        destination blocks hold garbage and must be recomputed or freed."""

    def check_pairing(self, prefill: Fingerprint) -> None:
        """D, at the Decode call (before anything is allocated) and before each pull: raise
        :class:`FingerprintMismatchError` naming both sides where this side cannot take the KV of
        a prefill instance of fingerprint ``prefill``. The fingerprint's own rule
        (:meth:`Fingerprint.check_compatible`); a backend adds what its transport cannot map."""
        self.fingerprint.check_compatible(prefill, "decode", "prefill")

    def check_source(self, source: KVSource) -> None:
        """D, before a pull: refuse a source this side cannot pair with (:meth:`check_pairing`),
        with a :class:`KVTransferError` naming both values."""
        try:
            self.check_pairing(source.fingerprint)
        except FingerprintMismatchError as error:
            raise KVTransferError(str(error)) from None

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening and drop connections. Called once at shutdown."""


def combined_stats(parts: list[TransferStats]) -> TransferStats:
    """One pull made of parts that ran at once (a rank's head spans, or every rank's share)."""
    return TransferStats(
        num_blocks=max((part.num_blocks for part in parts), default=0),
        num_bytes=sum(part.num_bytes for part in parts),
        seconds=max((part.seconds for part in parts), default=0.0),
        num_messages=sum(part.num_messages for part in parts),
    )


def block_count_error(num_block_ids: int, num_tokens: int, block_size: int) -> str | None:
    """None when ``num_block_ids`` blocks are exactly what ``num_tokens`` tokens fill; otherwise
    why not, for the caller's own error."""
    num_blocks = cdiv(num_tokens, block_size)
    if num_block_ids == num_blocks:
        return None
    return f"{num_block_ids} blocks for {num_tokens} tokens, which fill {num_blocks}"


async def bounded_transfer(operation: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await a transport operation within ``timeout_s``; a timeout, or any error the transport
    library raises in its own types, becomes a :class:`KVTransferError` naming ``what``."""
    try:
        return await asyncio.wait_for(operation, timeout=timeout_s)
    except TimeoutError:
        raise KVTransferError(f"{what} timed out after {timeout_s} s") from None
    except KVTransferError:
        raise
    except Exception as error:
        raise KVTransferError(f"{what} failed: {type(error).__name__}: {error}") from None
