"""KV transfer over UCX (ucxx): D asks P for blocks with a validated JSON header and
receives them in chunks, which P gathers and D scatters while other chunks are on the wire.

One pull, on a connection D keeps open between pulls (see :mod:`kv_connector.ucx_context`
for why an idle connection now costs nothing):

1. D -> P: a :class:`~kv_connector.wire.PullRequest` header (size-prefixed, as ucxx's
   ``send_obj`` frames it; see :mod:`kv_connector.ucx_messages`).
2. P -> D: a :class:`~kv_connector.wire.PullReply` header. When ``ok``, its ``shape``
   is the chunk layout ``[num_chunks, num_layers, 2, blocks_per_chunk, block_size,
   num_kv_heads, head_dim]``: the requested blocks in order, ``blocks_per_chunk`` per
   chunk (the last may hold fewer), each chunk laid out as ``gather_blocks`` lays out
   blocks. A peer speaking the former one-payload protocol (a 6-dim ``shape``) is
   refused by name, never misread.
3. P -> D: chunk ``k`` as one message tagged with (the pull's number on this
   connection, ``k``), from a ring of ``RING_DEPTH`` staging buffers on each side.

D posts its receives for the reply and the first chunks right after its request, so the
reply costs no round trip of its own, and writes nothing into its cache before the
reply is validated. Any failure or cancellation closes the connection, which cancels
whatever is still posted on it, so no later pull can receive an earlier pull's bytes;
its staging buffers are dropped rather than reused. D's cache is written only by the
connector's own scatter between awaits, so once :meth:`UCXConnector.pull` has returned
or raised (cancellation included) nothing writes into the destination blocks.

P reads the published blocks chunk by chunk; before each chunk it checks, on the event
loop that also runs :meth:`UCXConnector.unpublish`, that the request is still
published, so no chunk is read from blocks the engine may already have freed (the
engine unpins only after ``unpublish``).

On CPU, UCX moves host memory over TCP or shared memory; on GPU hosts the same code
sends device buffers and UCX picks cuda_ipc, NVLink or RDMA. For speed on one host set
``UCX_TLS=tcp,sm,self UCX_RNDV_SCHEME=put_zcopy`` (see docs/benchmarks.md). ucxx
listeners bind every address (ucxx 0.52 takes no bind address), so firewall the KV port.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_connector.base import KVConnector, KVSource, KVTransferError, TransferStats, bounded_transfer
from kv_connector.block_copy import BlockCopier
from kv_connector.fingerprint import Fingerprint, FingerprintMismatchError
from kv_connector.staging import StagingPool
from kv_connector.ucx_context import ucxx_for_running_loop
from kv_connector.ucx_messages import ChunkPlan, abandon, chunk_tag, header_buffer, recv_header, send_header, wire_buffer
from kv_connector.wire import PullReply, PullRequest, WireError, decode_pull_reply, decode_pull_request

logger = logging.getLogger(__name__)

# Chunk size: large enough that per-message costs (Python awaits, UCX's rendezvous) stay
# small, small enough that gather, wire and scatter of neighbouring chunks overlap. On the
# 2-core development VM 1.5 MiB was slower and 3 to 24 MiB within noise of each other
# (docs/benchmarks.md); 3 MiB keeps the staging rings small (SmolLM2: 8 blocks of 360 KiB).
CHUNK_BYTES = 3 << 20
RING_DEPTH = 3  # staging buffers per transfer and side: chunks in flight at once
MAX_IDLE_CONNECTIONS_PER_PEER = 4


@dataclass(slots=True)
class _Connection:
    """D's side of one connection to a P; pulls on it are numbered so that their chunk tags differ."""

    endpoint: object  # ucxx Endpoint
    num_pulls: int = 0
    header_buffer: np.ndarray = field(default_factory=header_buffer)


class _StaleConnection(Exception):
    """A reused connection failed before P answered: P restarted, or dropped it while idle."""


class UCXConnector(KVConnector):
    name = "ucx"

    def __init__(self, kv_cache: torch.Tensor, fingerprint: Fingerprint, blocks_per_chunk: int | None = None) -> None:
        """``blocks_per_chunk``: blocks per wire message (default: ``CHUNK_BYTES`` worth, at least one).
        P chooses it for the pulls it serves; D assumes its own value and refuses a reply that differs."""
        super().__init__(kv_cache, fingerprint)
        if blocks_per_chunk is not None and blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self.blocks_per_chunk = blocks_per_chunk or max(1, CHUNK_BYTES // self.bytes_per_block)
        self._copier = BlockCopier(kv_cache)
        self._staging = StagingPool(self.blocks_per_chunk * self.bytes_per_block, kv_cache.device, max_idle=2 * RING_DEPTH)
        self._published: dict[str, frozenset[int]] = {}
        self._listener = None
        self._serving: set[object] = set()  # P: endpoints a serving loop runs on
        self._idle: dict[str, list[_Connection]] = {}  # D: open connections between pulls, by P address
        self._num_transfers = 0  # pulls being served (P) or made (D) right now

    @property
    def num_transfers_in_flight(self) -> int:
        """Pulls this side is serving (P) or making (D) right now."""
        return self._num_transfers

    @property
    def num_serving_connections(self) -> int:
        """P: connections from decode instances, open between their pulls."""
        return len(self._serving)

    @property
    def num_idle_connections(self) -> int:
        """D: connections kept open for the next pull, over all prefill instances."""
        return sum(len(connections) for connections in self._idle.values())

    async def start(self, host: str, port: int) -> str:
        ucxx = ucxx_for_running_loop()
        self._staging.reserve(RING_DEPTH)
        self._listener = ucxx.create_listener(self._serve, port=port or None)
        address = f"{host}:{self._listener.port}"
        logger.info("UCX KV connector listening on %s", address)
        return address

    def publish(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> None:
        self._published[request_id] = frozenset(block_ids)

    def unpublish(self, request_id: str) -> None:
        self._published.pop(request_id, None)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        endpoints = [c.endpoint for connections in self._idle.values() for c in connections] + list(self._serving)
        self._idle.clear()
        for endpoint in endpoints:
            await abandon(endpoint, [])

    # ------------------------------------------------------------ P: serving

    async def _serve(self, endpoint) -> None:  # noqa: ANN001 - ucxx endpoint
        """One D connection: serve its pulls in order until D closes it."""
        self._serving.add(endpoint)
        try:
            pull_number = 0
            request_buffer = header_buffer()
            while True:
                try:
                    data = await recv_header(endpoint, request_buffer)
                except WireError as error:
                    logger.warning("closing a KV connection that sent %s", error)
                    return
                except Exception:  # noqa: BLE001 - D closed the connection (or died): the normal end
                    logger.debug("KV connection closed by the decode side", exc_info=True)
                    return
                pull_number += 1
                try:
                    await self._serve_pull(endpoint, pull_number, data)
                except Exception:  # a broken peer must never take the listener down
                    logger.warning("serving a KV pull failed; closing its connection", exc_info=True)
                    return
        finally:
            self._serving.discard(endpoint)
            await abandon(endpoint, [])

    async def _serve_pull(self, endpoint, pull_number: int, data: bytes) -> None:  # noqa: ANN001 - ucxx endpoint
        reply, request, published = self._answer(data)
        if request is not None:
            self._copier.check_block_ids(request.block_ids)  # published by the engine: in range unless there is a bug
        reply_sent = send_header(endpoint, reply)
        if request is None:
            await reply_sent
            return
        await asyncio.sleep(0)  # post the reply now, ahead of the first chunk
        plan = ChunkPlan(len(request.block_ids), self.blocks_per_chunk)
        ring = self._staging.acquire(min(RING_DEPTH, plan.num_chunks))
        sends: list[asyncio.Future | None] = [None] * len(ring)
        self._num_transfers += 1
        try:
            for chunk in range(plan.num_chunks):
                slot = chunk % len(ring)
                if sends[slot] is not None:
                    await sends[slot]  # the slot's previous chunk has left
                if self._published.get(request.request_id) is not published:
                    raise KVTransferError(f"request {request.request_id!r} was released during its pull")
                start, stop = plan.bounds(chunk)
                self._gather_chunk(request.block_ids[start:stop], ring[slot])
                message = wire_buffer(ring[slot][: (stop - start) * self.bytes_per_block])
                sends[slot] = asyncio.ensure_future(endpoint.send(message, tag=chunk_tag(pull_number, chunk)))
                await asyncio.sleep(0)  # let the send post before the next gather holds the loop
            await asyncio.gather(reply_sent, *(send for send in sends if send is not None))
        except BaseException:
            await abandon(endpoint, [reply_sent, *(send for send in sends if send is not None)])
            raise  # the ring is dropped: a send may still read it
        else:
            self._staging.release(ring)
        finally:
            self._num_transfers -= 1

    def _gather_chunk(self, block_ids: list[int], slot: torch.Tensor) -> None:
        self._copier.gather(block_ids, slot)

    def _answer(self, data: bytes) -> tuple[PullReply, PullRequest | None, frozenset[int] | None]:
        """The reply to a pull request and, when it is served, the request and the publication it reads."""
        try:
            request = decode_pull_request(data)
        except WireError as error:
            return PullReply(ok=False, error=f"bad pull request: {error}"), None, None
        try:
            self.fingerprint.check_compatible(request.fingerprint, "prefill", "decode")
        except FingerprintMismatchError as error:
            return PullReply(ok=False, error=str(error)), None, None
        published = self._published.get(request.request_id)
        if published is None:
            return PullReply(ok=False, error=f"no KV published for request {request.request_id!r} (released or expired)"), None, None
        if not published.issuperset(request.block_ids):
            return PullReply(ok=False, error=f"blocks {sorted(set(request.block_ids) - published)} are not the request's"), None, None
        if not request.block_ids:
            return PullReply(ok=False, error="a pull must name at least one block"), None, None
        plan = ChunkPlan(len(request.block_ids), self.blocks_per_chunk)
        reply = PullReply(
            ok=True,
            num_bytes=plan.num_blocks * self.bytes_per_block,
            shape=self._chunk_layout(plan),
            dtype=str(self.kv_cache.dtype).removeprefix("torch."),
        )
        return reply, request, published

    def _chunk_layout(self, plan: ChunkPlan) -> list[int]:
        layers, kv, _, block_size, heads, head_dim = self.kv_cache.shape
        return [plan.num_chunks, layers, kv, plan.blocks_per_chunk, block_size, heads, head_dim]

    # ------------------------------------------------------------- D: pulling

    async def pull(self, source: KVSource, block_ids: list[int], first_block: int, timeout_s: float) -> TransferStats:
        remote_blocks = list(source.block_ids[first_block:])
        local_blocks = block_ids[first_block:]
        if len(remote_blocks) != len(local_blocks):
            raise KVTransferError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones (bug)")
        if not remote_blocks:
            return TransferStats(num_blocks=0, num_bytes=0, seconds=0.0)
        self.check_source(source)
        self._copier.check_block_ids(local_blocks)
        start = time.perf_counter()
        await bounded_transfer(
            self._pull(source, remote_blocks, local_blocks), timeout_s, f"pulling {len(remote_blocks)} blocks from {source.address}"
        )
        return TransferStats(num_blocks=len(local_blocks), num_bytes=len(local_blocks) * self.bytes_per_block, seconds=time.perf_counter() - start)

    async def _pull(self, source: KVSource, remote_blocks: list[int], local_blocks: list[int]) -> None:
        """On an idle connection if there is one; if that one turns out stale, once more on a new one."""
        self._num_transfers += 1
        try:
            connection = self._take_idle(source.address)
            if connection is not None:
                try:
                    await self._pull_on(connection, source, remote_blocks, local_blocks, reused=True)
                except _StaleConnection as stale:
                    logger.info("idle KV connection to %s went stale (%s); reconnecting", source.address, stale)
                    connection = None
            if connection is None:
                connection = await self._connect(source.address)
                await self._pull_on(connection, source, remote_blocks, local_blocks, reused=False)
            await self._put_idle(source.address, connection)
        finally:
            self._num_transfers -= 1

    async def _pull_on(
        self, connection: _Connection, source: KVSource, remote_blocks: list[int], local_blocks: list[int], reused: bool
    ) -> None:
        endpoint = connection.endpoint
        connection.num_pulls += 1
        pull_number = connection.num_pulls
        plan = ChunkPlan(len(remote_blocks), self.blocks_per_chunk)
        ring = self._staging.acquire(min(RING_DEPTH, plan.num_chunks))
        pending: dict[int, asyncio.Future] = {}
        request_sent: asyncio.Future | None = None
        reply_task: asyncio.Future | None = None

        def post_receive(chunk: int) -> None:
            start, stop = plan.bounds(chunk)
            buffer = wire_buffer(ring[chunk % len(ring)][: (stop - start) * self.bytes_per_block])
            pending[chunk] = asyncio.ensure_future(endpoint.recv(buffer, tag=chunk_tag(pull_number, chunk)))

        request = PullRequest(source.request_id, remote_blocks, self.fingerprint)
        try:
            try:
                # Posted together, in order, when this task next yields: request, reply, first chunks.
                request_sent = send_header(endpoint, request)
                reply_task = asyncio.ensure_future(recv_header(endpoint, connection.header_buffer))
                for chunk in range(len(ring)):
                    post_receive(chunk)
                await request_sent
                data = await reply_task
            except WireError as error:
                raise KVTransferError(f"prefill instance {source.address} sent {error}") from None
            except Exception as error:
                if reused:
                    raise _StaleConnection(f"{type(error).__name__}: {error}") from None
                raise
            self._check_reply(source, data, plan)
            for chunk in range(plan.num_chunks):
                await pending.pop(chunk)
                start, stop = plan.bounds(chunk)
                self._copier.scatter(local_blocks[start:stop], ring[chunk % len(ring)])
                if chunk + len(ring) < plan.num_chunks:
                    post_receive(chunk + len(ring))
        except BaseException:
            # Drop the connection and the ring: a receive may still be posted into it.
            await abandon(endpoint, [task for task in (request_sent, reply_task, *pending.values()) if task is not None])
            raise
        self._staging.release(ring)

    def _check_reply(self, source: KVSource, data: bytes, plan: ChunkPlan) -> None:
        try:
            reply = decode_pull_reply(data)
        except WireError as error:
            raise KVTransferError(f"prefill instance {source.address} sent {error}") from None
        if not reply.ok:
            raise KVTransferError(f"prefill instance {source.address} refused the pull: {reply.error}")
        expected_shape = self._chunk_layout(plan)
        expected_bytes = plan.num_blocks * self.bytes_per_block
        expected_dtype = str(self.kv_cache.dtype).removeprefix("torch.")
        if reply.shape is not None and len(reply.shape) != len(expected_shape):
            raise KVTransferError(
                f"prefill instance {source.address} offers one {reply.shape} payload, the former UCX KV protocol; "
                "run the same splitserve version on prefill and decode instances"
            )
        if reply.shape != expected_shape or reply.num_bytes != expected_bytes or reply.dtype != expected_dtype:
            raise KVTransferError(
                f"prefill instance {source.address} offers chunks {reply.shape} ({reply.num_bytes} bytes of {reply.dtype}), "
                f"expected {expected_shape} ({expected_bytes} bytes of {expected_dtype}); "
                "blocks_per_chunk must be the same on prefill and decode instances"
            )

    async def _connect(self, address: str) -> _Connection:
        ucxx = ucxx_for_running_loop()
        host, _, port = address.rpartition(":")
        return _Connection(await ucxx.create_endpoint(host, int(port)))

    def _take_idle(self, address: str) -> _Connection | None:
        connections = self._idle.get(address)
        while connections:
            connection = connections.pop()
            if not connection.endpoint.closed:
                return connection
        return None

    async def _put_idle(self, address: str, connection: _Connection) -> None:
        connections = self._idle.setdefault(address, [])
        if len(connections) < MAX_IDLE_CONNECTIONS_PER_PEER:
            connections.append(connection)
        else:
            await abandon(connection.endpoint, [])
