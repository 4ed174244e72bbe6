"""KV transfer over UCX (ucxx), zero-copy: P sends each block straight out of its KV
cache and D receives it straight into its own, so the bytes are copied once, by UCX,
as they would be by a raw ucxx send of one buffer.

The cache is block-major (engine/kv_cache_layout.py): block ``b`` is the contiguous
``kv_cache[b]``, every layer's K and V. One pull, on a connection D keeps open between
pulls (see :mod:`kv_connector.ucx_context` for why an idle connection costs nothing):

1. D -> P: a :class:`~kv_connector.wire.PullRequest` header (one size-prefixed
   message; see :mod:`kv_connector.ucx_messages`): P's block ids and
   how D cuts them into messages, each a run of blocks consecutive on both sides (so
   one contiguous span of each cache), at most ``MAX_MESSAGE_BYTES`` long.
2. P -> D: a :class:`~kv_connector.wire.PullReply` header: refused with a reason, or the
   layout of one block, which D compares with its own.
3. P -> D: message ``k`` tagged with (the pull's number on this connection, ``k``), at
   most ``WINDOW`` in flight on each side; then, when the pull asked for it and the reply
   offered it, the EAGLE draft's KV over the prompt as one more message (kv_connector/draft_kv.py),
   which D receives into a tensor it sized itself from its own prompt and draft. A pull that asks
   for the draft KV may name no block (D's prefix cache held them all: it caches no draft KV).

D posts the reply's receive and its first block receives right after its request, so
the reply costs no round trip of its own. Receives are sized from D's own blocks, so a
peer can only ever write the blocks D asked for, and P sends only after an ``ok`` reply.

Who may touch which memory, and until when:

- P reads a request's blocks only while they are published: :meth:`UCXConnector.unpublish`
  (called before the engine frees them) cuts off a pull still reading them, by closing its
  connection, which completes every UCX request on it, and returns only then.
- D's blocks are written by UCX, on P's initiative where UCX moves data with remote
  writes (shared memory, cuda_ipc, RDMA put). A pull that fails or is cancelled, unless
  P refused it, therefore first waits up to ``SETTLE_S`` for the receives it posted, so
  that no write P has started lands after :meth:`UCXConnector.pull` has returned; then it
  closes the connection. A peer alive but stalled for longer than that could still
  write later into blocks D has handed on (UCX cannot revoke a remote write it granted);
  a dead peer writes nothing.

On CPU, UCX moves host memory over TCP or shared memory; on GPU hosts the same code
sends device buffers and UCX picks cuda_ipc, NVLink or RDMA (P's KV is complete before
it is published: the engine reads the sampled token back, which waits for the forward
pass). For speed on one host set ``UCX_TLS=tcp,sm,self UCX_RNDV_SCHEME=put_zcopy``
(docs/benchmarks.md, "KV transfer").

A late write cannot land in a reused block through the messages themselves: D closes a
connection whose pull failed (it never serves another pull), every receive is tagged with
its pull's number on its connection (and ucxx mixes the connection into every tag), so a
message P sends after D's settle window matches nothing D posted later, into whatever
blocks (tests/kv_connector/test_ucx.py holds P's message back past the window, reuses the
blocks for another pull, then lets it go). What the window cannot rule out is a transport
writing into D's memory on P's side (``UCX_RNDV_SCHEME=put_zcopy`` over shared memory,
RDMA puts) after a rendezvous D had already matched, when P stalls mid-transfer for longer
than ``SETTLE_S``: the receiver-driven default (``get_zcopy``) does not write from P's side.

Tensor parallelism: each rank runs its own connector over its own cache, which holds its
KV heads of every block. A pull may name a span of P's heads (``PullRequest.heads``, from the
head plan, kv_connector/head_plan.py): P then copies those heads of each message's blocks
into a staging buffer and sends that, and D receives it straight into its blocks when the
span is all of its own heads, or into a staging buffer it scatters into its heads otherwise.
Without a span (same layout on both sides) nothing is staged.

Pipeline parallelism: each rank's cache holds its stage's layers alone, so a pull may also name
a range of P's layers (``PullRequest.layers``); the layer plan (kv_connector/layer_plan.py) gives
each D rank its (layer range, head span) pulls, each from the P rank holding it, and P copies
that range of those heads out of each message's blocks as it copies a head span.

Who may pull: P serves a pull only for a request it published, only of that request's
blocks, and, when it published with a pull token (the prefill service always does; the
token travels in the signed KV handle), only to a pull presenting that token, compared in
constant time before anything past the request's fixed frame is parsed
(:func:`~kv_connector.wire.read_pull_credentials`), and only once: a handle is good for
one pull of each (layer range, head span) the layer plan gives this rank for the pulling
instance's layout (one, when both are one rank). ucxx 0.52's listener binds every address
(it takes none); on a loopback host the connector limits UCX's data lanes to ``lo``
(:mod:`kv_connector.ucx_context`), elsewhere firewall the KV port (docs/security.md).
Whoever reaches the port gets little before proving anything: at most ``max_connections``
connections at once (one past that is closed at once); a connection's headers are received
into a buffer just large enough for a pull of the whole cache
(:func:`~kv_connector.wire.max_pull_request_bytes`), so UCX refuses a longer one before
anything is read; its first header must come within ``FIRST_FRAME_TIMEOUT_S``; after a
refused pull (bad token, spent token, unknown request, malformed header) and its reply,
nothing more is read from the connection (D closes it; a stranger gets
``FIRST_FRAME_TIMEOUT_S``), so each connection costs at most one read of a request's frame,
and a parse of the rest only with the request's token; and refusals are logged once, then
once every thousand (as refused gRPC calls are, ``cluster/auth.py``), counted in
``num_refused``. P closes a connection idle for ``IDLE_TIMEOUT_S``; D reuses one only while
it has been idle for less than half that.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.spec_decode.prompt_draft_kv import DraftKVShape, PromptDraftKV
from kv_connector.base import (
    KVConnector,
    KVSource,
    KVTransferError,
    PublishedKV,
    TransferStats,
    bounded_transfer,
    combined_stats,
)
from kv_connector.draft_kv import DraftKVCarrier, draft_offer_error
from kv_connector.fingerprint import Fingerprint, FingerprintMismatchError
from kv_connector.layer_plan import KVSpan, plan_kv_pulls
from kv_connector.ucx_context import limit_to_loopback, ucxx_for_running_loop
from kv_connector.ucx_messages import (
    Endpoint,
    WireBuffer,
    abandon,
    consecutive_runs_error,
    header_buffer,
    message_spans,
    message_tag,
    plan_messages,
    recv_header,
    send_header,
    wire_buffer,
)
from kv_connector.wire import (
    PullReply,
    PullRequest,
    WireError,
    decode_pull_body,
    decode_pull_reply,
    max_pull_request_bytes,
    read_pull_credentials,
)

logger = logging.getLogger(__name__)

# Messages: large enough that per-message costs (Python awaits, UCX's rendezvous) stay
# small, small enough that several are in flight at once. The window: enough messages in
# flight to keep the transport busy, few enough that ucxx's futures pool holds them (it
# warns, and allocates, beyond). Measurements behind both sizes: docs/benchmarks.md, "KV transfer".
MAX_MESSAGE_BYTES = 4 << 20
WINDOW = 32  # messages in flight per pull and side
SETTLE_S = 1.0  # how long a failed pull waits for writes P may have started (module docstring)
MAX_IDLE_CONNECTIONS_PER_PEER = 4
# P closes a connection no pull has used for this long, so connections nobody uses (a
# decode instance gone quiet, or someone who connected and never asked) do not pile up.
# D reuses a connection only while it has been idle for less than half of this.
IDLE_TIMEOUT_S = 60.0
# P: connections served at once (decode instances keep a few idle per prefill instance, plus one
# per pull in flight); one past this is closed as it arrives.
MAX_CONNECTIONS = 1024
# P: a connection that has not carried a served pull yet must send its first header this soon
# (D sends its pull request as soon as it connects), so strangers cannot hold connections.
FIRST_FRAME_TIMEOUT_S = 10.0
_LOG_REFUSALS_EVERY = 1000  # a flood of refused connections and pulls must not flood the log too


@dataclass(slots=True)
class _Connection:
    """D's side of one connection to a P; pulls on it are numbered so that their message tags differ."""

    endpoint: Endpoint
    num_pulls: int = 0
    header_buffer: np.ndarray = field(default_factory=header_buffer)
    idle_since: float = 0.0  # monotonic; set when the connection goes back to the idle pool


@dataclass(slots=True)
class _Published:
    """P: a request's blocks, and the token a pull of them must present (None: any pull)."""

    block_ids: frozenset[int]
    pull_token: bytes | None
    # With a token: the spans (layer first, count, head first, count) the pulling instance's ranks
    # may still pull, from the layer plan for its layout, set by its first pull; each is good once.
    spans_left: Counter[_SpanKey] | None = None
    # The EAGLE draft's KV over the prompt, for pulls that ask for it (kv_connector/draft_kv.py).
    draft_kv: PromptDraftKV | None = None


@dataclass(slots=True)
class _DraftReceive:
    """D: the draft KV a pull asks for, of this shape, and what came (None: P had none)."""

    shape: DraftKVShape
    received: PromptDraftKV | None = None


class _StaleConnection(Exception):
    """A reused connection failed before P answered: P restarted, or dropped it while idle."""


class UCXConnector(KVConnector, DraftKVCarrier):
    name = "ucx"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        fingerprint: Fingerprint,
        max_message_blocks: int | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        first_frame_timeout_s: float = FIRST_FRAME_TIMEOUT_S,
        tensor_parallel_rank: int = 0,
        pipeline_stage: int = 0,
    ) -> None:
        """``max_message_blocks``: the most blocks D puts in one message (default: ``MAX_MESSAGE_BYTES``
        worth, at least one). Only the pulling side's value matters: it names the messages.
        ``idle_timeout_s``: P closes a connection that has carried no pull for this long;
        ``max_connections``: P serves at most this many at once; ``first_frame_timeout_s``: P
        closes a connection whose first header has not come after this long;
        ``tensor_parallel_rank``, ``pipeline_stage``: the rank whose cache this is (its KV heads
        of its stage's layers are that rank's)."""
        super().__init__(kv_cache, fingerprint)
        self.tensor_parallel_rank = tensor_parallel_rank
        # This rank's place in its instance's stage-major order (kv_connector/layer_plan.py).
        self.rank = pipeline_stage * fingerprint.tensor_parallel_size + tensor_parallel_rank
        if max_message_blocks is not None and max_message_blocks < 1:
            raise ValueError(f"max_message_blocks must be >= 1, got {max_message_blocks}")
        for name, seconds in (("idle_timeout_s", idle_timeout_s), ("first_frame_timeout_s", first_frame_timeout_s)):
            if seconds <= 0:
                raise ValueError(f"{name} must be positive, got {seconds}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_message_blocks = max_message_blocks or max(1, MAX_MESSAGE_BYTES // self.bytes_per_block)
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.first_frame_timeout_s = first_frame_timeout_s
        self.max_request_bytes = max_pull_request_bytes(self.num_blocks)  # P: the cap on a pull request
        self.num_refused = 0  # P: connections and pulls refused since start
        self._cache_bytes = wire_buffer(kv_cache)
        self._published: dict[str, _Published] = {}
        self._readers: dict[str, set[asyncio.Task]] = {}  # P: the pulls reading a request's blocks
        self._listener: Any = None  # P: the ucxx listener, once started (ucxx ships no types)
        self._serving: set[Endpoint] = set()  # P: endpoints a serving loop runs on
        self._idle: dict[str, list[_Connection]] = {}  # D: open connections between pulls, by P address
        self._num_transfers = 0  # pulls being served (P) or made (D) right now

    @property
    def num_transfers_in_flight(self) -> int:
        return self._num_transfers

    @property
    def num_connections(self) -> int:
        # P serves endpoints and D keeps idle ones; one instance is one or the other.
        return len(self._serving) + sum(len(connections) for connections in self._idle.values())

    async def start(self, host: str, port: int) -> str:
        if limit_to_loopback(host):
            logger.info(
                "UCX data lanes limited to the loopback device (UCX_NET_DEVICES=lo): %s is a loopback address", host
            )
        ucxx = ucxx_for_running_loop()
        self._listener = ucxx.create_listener(self._serve, port=port or None)
        address = f"{host}:{self._listener.port}"
        logger.info("UCX KV connector listening on %s", address)
        return address

    async def publish(
        self,
        request_id: str,
        block_ids: list[int],
        token_ids: list[int],
        pull_token: bytes | None = None,
        cache_salt: str = "",
    ) -> PublishedKV:
        """Nothing is copied: pulls read the blocks where they are (``token_ids`` and the salt unused)."""
        self._published[request_id] = _Published(frozenset(block_ids), pull_token)
        return PublishedKV()

    async def publish_draft_kv(
        self, request_id: str, draft_kv: PromptDraftKV, pull_token: bytes | None = None, cache_salt: str = ""
    ) -> bytes:
        """:meth:`attach_draft_kv`: nothing for the handle, P sends the bytes itself."""
        self.attach_draft_kv(request_id, draft_kv)
        return b""

    def attach_draft_kv(self, request_id: str, draft_kv: PromptDraftKV) -> None:
        """Sent from where it is, as the blocks are; dropped with them at :meth:`unpublish`."""
        published = self._published.get(request_id)
        if published is not None:
            published.draft_kv = draft_kv

    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
        self._published.pop(request_id, None)
        readers = self._readers.pop(request_id, set())
        if readers and grace_s > 0:
            _, readers = await asyncio.wait(readers, timeout=grace_s)
        for reader in readers:
            reader.cancel()
        if readers:
            await asyncio.wait(readers)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        endpoints = [c.endpoint for connections in self._idle.values() for c in connections] + list(self._serving)
        self._idle.clear()
        for endpoint in endpoints:
            await abandon(endpoint, [])

    def _blocks(self, first: int, count: int) -> WireBuffer:
        """Blocks ``first .. first + count - 1`` of the cache, one contiguous span, as a wire buffer:
        a slice of one byte view made up front (slicing costs well under a microsecond, where
        making a view of a tensor slice costs several, and a pull of scattered blocks makes
        one per block)."""
        return self._cache_bytes[first * self.bytes_per_block : (first + count) * self.bytes_per_block]

    # ------------------------------------------------------------ P: serving

    async def _serve(self, endpoint) -> None:
        """One D connection: serve its pulls in order until D closes it, it idles out, or one
        is refused (module docstring)."""
        if len(self._serving) >= self.max_connections:
            self._refuse("closed a KV connection: %d are open, the most this instance serves", len(self._serving))
            await abandon(endpoint, [])
            return
        self._serving.add(endpoint)
        try:
            pull_number = 0
            request_buffer = header_buffer(self.max_request_bytes)
            while True:
                # Until it has carried a pull, a connection is a stranger's: its first header comes soon or never.
                timeout_s = self.idle_timeout_s if pull_number else min(self.idle_timeout_s, self.first_frame_timeout_s)
                try:
                    # asyncio.timeout, not wait_for: it creates no task of its own for each pull.
                    async with asyncio.timeout(timeout_s):
                        data = await recv_header(endpoint, request_buffer)
                except TimeoutError:
                    state = "idle" if pull_number else "silent"
                    logger.debug("closing a KV connection %s for %.0f s", state, timeout_s)
                    return
                except WireError as error:
                    self._refuse("closed a KV connection that sent %s", error)
                    return
                except Exception:
                    logger.debug("KV connection closed by the decode side", exc_info=True)
                    return
                pull_number += 1
                reply, request = self._answer(data)
                if request is None:  # refused: the reply says why, and the connection carries nothing more
                    await send_header(endpoint, reply)
                    await self._until_closed(endpoint)
                    return
                # Taken now, while the request is surely published (an unpublish cuts the send off).
                draft_kv = self._published[request.request_id].draft_kv if reply.draft_kv is not None else None
                # Registered before the next await, so an unpublish from here on finds it.
                sending = asyncio.ensure_future(self._send_blocks(endpoint, pull_number, reply, request, draft_kv))
                self._readers.setdefault(request.request_id, set()).add(sending)
                sending.add_done_callback(functools.partial(self._forget_reader, request.request_id))
                try:
                    await asyncio.wait([sending])
                except BaseException:  # the listener is shutting down: stop reading the blocks too
                    sending.cancel()
                    raise
                if sending.cancelled():
                    self.num_pulls_cut_off += 1
                    logger.warning("pull of %s cut off: its KV was released while being read", request.request_id)
                    return
                if sending.exception() is not None:  # a broken peer must never take the listener down
                    logger.warning("serving a KV pull failed; closing its connection", exc_info=sending.exception())
                    return
        except Exception:
            logger.debug("KV connection failed", exc_info=True)
        finally:
            self._serving.discard(endpoint)
            await abandon(endpoint, [])

    async def _until_closed(self, endpoint: Endpoint) -> None:
        """After a refusal: read nothing more from the connection, but leave closing it to D,
        which does on reading the reply (a peer closing first would fail D's receives still
        posted); one that does not gets ``first_frame_timeout_s``."""
        try:
            async with asyncio.timeout(self.first_frame_timeout_s):
                await endpoint.recv(np.empty(1, dtype=np.uint8))  # whatever comes is dropped, unread
        except Exception:
            logger.debug("a refused KV connection ended", exc_info=True)

    async def _send_blocks(
        self,
        endpoint: Endpoint,
        pull_number: int,
        reply: PullReply,
        request: PullRequest,
        draft_kv: PromptDraftKV | None = None,
    ) -> None:
        """Send the reply, then every message straight from the cache, then the draft KV if the
        reply offered it (one message, tagged as the message after the blocks'). On any failure
        or cancellation the connection is closed before this returns, which ends every send."""
        self._num_transfers += 1
        reply_sent = send_header(endpoint, reply)
        sends: deque[asyncio.Future] = deque()
        span = self._span(request)
        try:
            await asyncio.sleep(0)  # post the reply now, ahead of the first message
            for index, (first, count) in enumerate(message_spans(request.block_ids, request.message_blocks)):
                if len(sends) >= WINDOW:
                    await sends.popleft()
                if span is None:
                    payload = self._blocks(first, count)
                else:  # a span of this rank's layers and heads: copied out, and kept alive by the send's closure
                    layer, num_layers, head, num_heads = span
                    blocks = self.kv_cache[first : first + count, layer : layer + num_layers]
                    payload = wire_buffer(blocks[:, :, :, :, head : head + num_heads].clone())
                sends.append(self._send(endpoint, payload, message_tag(pull_number, index)))
            if draft_kv is not None:
                draft_tag = message_tag(pull_number, len(request.message_blocks))
                sends.append(self._send(endpoint, wire_buffer(draft_kv.kv), draft_tag))
            await asyncio.gather(reply_sent, *sends)
        except BaseException:
            await abandon(endpoint, [reply_sent, *sends])
            raise
        finally:
            self._num_transfers -= 1

    def _send(self, endpoint: Endpoint, blocks: WireBuffer, tag: int) -> asyncio.Future:
        return asyncio.ensure_future(endpoint.send(blocks, tag=tag))

    @property
    def num_local_heads(self) -> int:
        return self.kv_cache.shape[4]

    @property
    def num_local_layers(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def _whole(self) -> _SpanKey:
        return (0, self.num_local_layers, 0, self.num_local_heads)

    def _span(self, request: PullRequest) -> _SpanKey | None:
        """The (layer first, count, head first, count) of this rank's cache a pull sends; None:
        all of it, unstaged."""
        span = _span_key(request, self._whole)
        return None if span == self._whole else span

    def _forget_reader(self, request_id: str, task: asyncio.Task) -> None:
        readers = self._readers.get(request_id)
        if readers is not None:
            readers.discard(task)
            if not readers:
                del self._readers[request_id]

    def _refuse(self, message: str, *args: object) -> None:
        """Count a refused connection or pull; log the first and then one in
        ``_LOG_REFUSALS_EVERY``, so a flood of them does not flood the log."""
        self.num_refused += 1
        if self.num_refused % _LOG_REFUSALS_EVERY == 1:
            logger.warning(message + " (%d refused since start)", *args, self.num_refused)

    def _answer(self, data: bytes) -> tuple[PullReply, PullRequest | None]:
        """The reply to a pull request and, when it is served, the request."""
        reply, request = self._check(data)
        if request is None:
            self._refuse("refused a KV pull: %s", reply.error)
        else:
            published = self._published[request.request_id]
            if published.spans_left is not None:
                published.spans_left[_span_key(request, self._whole)] -= 1  # spent: good once
        return reply, request

    def _spans_allowed(self, fingerprint: Fingerprint) -> Counter[_SpanKey]:
        """The spans of this rank that the ranks of an instance of ``fingerprint``'s layout pull."""
        plans = plan_kv_pulls(self.fingerprint.num_kv_heads, self.fingerprint.layout, fingerprint.layout)
        return Counter(
            (span.source_layer_start, span.num_layers, span.source_head_start, span.num_heads)
            for spans in plans
            for span in spans
            if span.source_rank == self.rank
        )

    def _check(self, data: bytes) -> tuple[PullReply, PullRequest | None]:
        # Who asks, from the request's fixed frame alone: the rest (JSON, every block id) is
        # parsed only for a pull of a published request that presents its token.
        try:
            credentials, body = read_pull_credentials(data)
        except WireError as error:
            return PullReply(ok=False, error=f"bad pull request: {error}"), None
        published = self._published.get(credentials.request_id)
        if published is None:
            return PullReply(
                ok=False, error=f"no KV published for request {credentials.request_id!r} (released or expired)"
            ), None
        if published.pull_token is not None and not hmac.compare_digest(credentials.pull_token, published.pull_token):
            return PullReply(
                ok=False, error=f"the pull token for request {credentials.request_id!r} does not match the KV handle's"
            ), None
        try:
            request = decode_pull_body(credentials, body)
        except WireError as error:
            return PullReply(ok=False, error=f"bad pull request: {error}"), None
        try:
            self.fingerprint.check_compatible(request.fingerprint, "prefill", "decode")
        except FingerprintMismatchError as error:
            return PullReply(ok=False, error=str(error)), None
        span = _span_key(request, self._whole)
        if span[2] + span[3] > self.num_local_heads:
            return PullReply(
                ok=False, error=f"heads {request.heads} outside this rank's {self.num_local_heads} KV heads"
            ), None
        if span[0] + span[1] > self.num_local_layers:
            return PullReply(
                ok=False, error=f"layers {request.layers} outside this rank's {self.num_local_layers} layers"
            ), None
        if published.pull_token is not None:
            if published.spans_left is None:
                published.spans_left = self._spans_allowed(request.fingerprint)
            if published.spans_left[span] <= 0:
                return PullReply(
                    ok=False,
                    error=f"the pull token for request {request.request_id!r} was spent: a KV handle serves one pull "
                    "of each (layer range, head span)",
                ), None
        if not published.block_ids.issuperset(request.block_ids):
            return PullReply(
                ok=False, error=f"blocks {sorted(set(request.block_ids) - published.block_ids)} are not the request's"
            ), None
        if not request.block_ids and not request.draft_kv:
            return PullReply(ok=False, error="a pull must name at least one block"), None
        if (plan_error := consecutive_runs_error(request.block_ids, request.message_blocks)) is not None:
            return PullReply(ok=False, error=f"bad message plan: {plan_error}"), None
        self.check_block_ids(request.block_ids)  # published by the engine: in range unless there is a bug
        draft_kv = published.draft_kv if request.draft_kv and span == self._whole else None
        reply = PullReply(
            ok=True,
            num_bytes=len(request.block_ids) * self._bytes_per_block_of(span[3], span[1]),
            shape=self._block_shape(span[3], span[1]),
            dtype=str(self.kv_cache.dtype).removeprefix("torch."),
            draft_kv=[draft_kv.start, draft_kv.num_entries] if draft_kv is not None else None,
            draft_shape=_entry_shape(draft_kv) if draft_kv is not None else None,
            draft_dtype=str(draft_kv.kv.dtype).removeprefix("torch.") if draft_kv is not None else "",
        )
        return reply, request

    def _block_shape(self, num_heads: int, num_layers: int) -> list[int]:
        """One block's shape on the wire: ``num_heads`` of this rank's heads of ``num_layers`` of its layers."""
        shape = list(self.kv_cache.shape[1:])
        shape[0], shape[3] = num_layers, num_heads
        return shape

    def _bytes_per_block_of(self, num_heads: int, num_layers: int) -> int:
        return self.bytes_per_block // (self.num_local_heads * self.num_local_layers) * num_heads * num_layers

    # ------------------------------------------------------------- D: pulling

    async def pull(
        self, source: KVSource, block_ids: list[int], num_local_hit_blocks: int, timeout_s: float
    ) -> TransferStats:
        """This rank's share: its KV heads of its layers, each (layer range, head span) from the P
        rank the layer plan names (kv_connector/layer_plan.py; one whole-block pull from P when
        both are one rank)."""
        self.check_source(source)
        addresses = source.rank_addresses or (source.address,)
        source_layout = source.fingerprint.layout
        if len(addresses) != source_layout.num_ranks:
            raise KVTransferError(
                f"the KV handle names {len(addresses)} rank addresses for a prefill instance of "
                f"{source_layout.num_ranks} ranks ({source_layout.describe()})"
            )
        plan = plan_kv_pulls(self.fingerprint.num_kv_heads, source_layout, self.fingerprint.layout)
        stats = await asyncio.gather(
            *(
                self.pull_span(source, addresses[span.source_rank], block_ids, num_local_hit_blocks, timeout_s, span)
                for span in plan[self.rank]
            )
        )
        return combined_stats(stats)

    async def pull_with_draft_kv(
        self,
        source: KVSource,
        block_ids: list[int],
        num_local_hit_blocks: int,
        timeout_s: float,
        draft_shape: DraftKVShape,
    ) -> tuple[TransferStats, PromptDraftKV | None]:
        """One rank on each side (an EAGLE draft runs on a whole target): one pull of the blocks
        and the draft KV. Otherwise the blocks alone."""
        if source.rank_addresses or self.fingerprint.layout.num_ranks != 1:
            return await self.pull(source, block_ids, num_local_hit_blocks, timeout_s), None
        draft = _DraftReceive(draft_shape)
        stats = await self.pull_heads(source, source.address, block_ids, num_local_hit_blocks, timeout_s, draft=draft)
        return stats, draft.received

    async def pull_span(
        self,
        source: KVSource,
        address: str,
        block_ids: list[int],
        num_local_hit_blocks: int,
        timeout_s: float,
        span: KVSpan,
    ) -> TransferStats:
        """:meth:`pull_heads` of one span of the layer plan."""
        return await self.pull_heads(
            source,
            address,
            block_ids,
            num_local_hit_blocks,
            timeout_s,
            source_heads=(span.source_head_start, span.num_heads),
            target_start=span.target_head_start,
            source_layers=(span.source_layer_start, span.num_layers),
            target_layer_start=span.target_layer_start,
        )

    async def pull_heads(
        self,
        source: KVSource,
        address: str,
        block_ids: list[int],
        num_local_hit_blocks: int,
        timeout_s: float,
        source_heads: tuple[int, int] | None = None,
        target_start: int = 0,
        source_layers: tuple[int, int] | None = None,
        target_layer_start: int = 0,
        draft: _DraftReceive | None = None,
    ) -> TransferStats:
        """:meth:`pull` from the rank at ``address``, of the span ``source_heads`` (first, count)
        of its heads (None: all of them, which must be all of this rank's) into this rank's
        heads from ``target_start`` on, and likewise of the range ``source_layers`` of its layers
        into this rank's from ``target_layer_start`` on (kv_connector/layer_plan.py says which)."""
        num_heads = source_heads[1] if source_heads is not None else self.num_local_heads
        num_layers = source_layers[1] if source_layers is not None else self.num_local_layers
        if target_start + num_heads > self.num_local_heads:
            raise KVTransferError(f"heads {target_start}..{target_start + num_heads} outside this rank's (bug)")
        if target_layer_start + num_layers > self.num_local_layers:
            raise KVTransferError(
                f"layers {target_layer_start}..{target_layer_start + num_layers} outside this rank's (bug)"
            )
        remote_blocks = list(source.block_ids[num_local_hit_blocks:])
        local_blocks = block_ids[num_local_hit_blocks:]
        if len(remote_blocks) != len(local_blocks):
            raise KVTransferError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones (bug)")
        if not remote_blocks and draft is None:
            return TransferStats(num_blocks=0, num_bytes=0, seconds=0.0)
        self.check_source(source)
        self.check_block_ids(local_blocks)
        start = time.perf_counter()
        message_blocks = plan_messages(remote_blocks, local_blocks, self.max_message_blocks)
        heads = _HeadTransfer(
            list(source_heads) if source_heads is not None else None,
            target_start,
            num_heads,
            list(source_layers) if source_layers is not None else None,
            target_layer_start,
            num_layers,
        )
        await bounded_transfer(
            self._pull(source, address, remote_blocks, local_blocks, message_blocks, heads, draft),
            timeout_s,
            f"pulling {len(remote_blocks)} blocks from {address}",
        )
        received = draft.received if draft is not None else None
        return TransferStats(
            num_blocks=len(local_blocks),
            num_bytes=len(local_blocks) * self._bytes_per_block_of(num_heads, num_layers)
            + (received.kv.nbytes if received is not None else 0),
            seconds=time.perf_counter() - start,
            num_messages=len(message_blocks) + (received is not None),
        )

    async def _pull(
        self,
        source: KVSource,
        address: str,
        remote_blocks: list[int],
        local_blocks: list[int],
        message_blocks: list[int],
        heads: _HeadTransfer,
        draft: _DraftReceive | None = None,
    ) -> None:
        """On an idle connection if there is one; if that one turns out stale, once more on a new one."""
        self._num_transfers += 1
        pull = functools.partial(
            self._pull_on,
            source=source,
            address=address,
            remote_blocks=remote_blocks,
            local_blocks=local_blocks,
            message_blocks=message_blocks,
            heads=heads,
            draft=draft,
        )
        try:
            connection = await self._take_idle(address)
            if connection is not None:
                try:
                    await pull(connection, reused=True)
                except _StaleConnection as stale:
                    logger.info("idle KV connection to %s went stale (%s); reconnecting", address, stale)
                    connection = None
            if connection is None:
                connection = await self._connect(address)
                await pull(connection, reused=False)
            await self._put_idle(address, connection)
        finally:
            self._num_transfers -= 1

    async def _pull_on(
        self,
        connection: _Connection,
        *,
        source: KVSource,
        address: str,
        remote_blocks: list[int],
        local_blocks: list[int],
        message_blocks: list[int],
        heads: _HeadTransfer,
        reused: bool,
        draft: _DraftReceive | None = None,
    ) -> None:
        endpoint = connection.endpoint
        connection.num_pulls += 1
        pull_number = connection.num_pulls
        spans = list(message_spans(local_blocks, message_blocks))
        receives: deque[asyncio.Future] = deque()
        num_posted = 0
        request_sent: asyncio.Future | None = None
        reply_task: asyncio.Future | None = None
        refused = False  # P said no: it sends nothing, so nothing it started can still land

        staged = heads.num_heads != self.num_local_heads or heads.num_layers != self.num_local_layers

        def post_receive() -> None:
            nonlocal num_posted
            first, count = spans[num_posted]
            tag = message_tag(pull_number, num_posted)
            if staged:  # a span of this rank's layers and heads: received whole, then put in place
                staging = self.kv_cache.new_empty((count, *self._block_shape(heads.num_heads, heads.num_layers)))
                receive = endpoint.recv(wire_buffer(staging), tag=tag)
                layers = self.kv_cache[first : first + count, heads.target_layer_start : heads.target_layer_stop]
                target = layers[:, :, :, :, heads.target_start : heads.target_stop]
                receives.append(asyncio.ensure_future(_then_copy(receive, staging, target)))
            else:
                receives.append(asyncio.ensure_future(endpoint.recv(self._blocks(first, count), tag=tag)))
            num_posted += 1

        request = PullRequest(
            source.request_id,
            remote_blocks,
            self.fingerprint,
            message_blocks,
            source.pull_token,
            heads=heads.source,
            layers=heads.source_layers,
            draft_kv=draft is not None,
        )
        try:
            try:
                # Posted together, in order, when this task next yields: request, reply, first messages.
                request_sent = send_header(endpoint, request)
                reply_task = asyncio.ensure_future(recv_header(endpoint, connection.header_buffer))
                while num_posted < min(WINDOW, len(spans)):
                    post_receive()
                await request_sent
                data = await reply_task
            except WireError as error:
                raise KVTransferError(f"prefill instance {address} sent {error}") from None
            except Exception as error:
                if reused:
                    raise _StaleConnection(f"{type(error).__name__}: {error}") from None
                raise
            reply = self._decode_reply(address, data)
            refused = not reply.ok
            self._check_reply(address, reply, len(remote_blocks), heads.num_heads, heads.num_layers)
            incoming: PromptDraftKV | None = None
            if draft is not None and reply.draft_kv is not None:
                start, num_entries = reply.draft_kv
                offer = (start, num_entries, reply.draft_shape, reply.draft_dtype, source.num_tokens, draft.shape)
                if (refusal := draft_offer_error(*offer)) is not None:
                    raise KVTransferError(f"prefill instance {address} offers {refusal}")
                # Kept only once every message has landed: a failed pull leaves none behind.
                incoming = draft.shape.empty(start, num_entries)
                tag = message_tag(pull_number, len(spans))
                receives.append(asyncio.ensure_future(endpoint.recv(wire_buffer(incoming.kv), tag=tag)))
            while receives:
                await receives.popleft()
                if num_posted < len(spans):
                    post_receive()
            if draft is not None:
                draft.received = incoming
        except BaseException:
            try:
                if receives and not refused:
                    await asyncio.wait(receives, timeout=SETTLE_S)  # writes P started land now or never
            finally:
                # Drop the connection: closing it cancels what is still posted on it.
                await abandon(endpoint, [task for task in (request_sent, reply_task, *receives) if task is not None])
            raise

    def _decode_reply(self, address: str, data: bytes) -> PullReply:
        try:
            return decode_pull_reply(data)
        except WireError as error:
            raise KVTransferError(f"prefill instance {address} sent {error}") from None

    def _check_reply(self, address: str, reply: PullReply, num_blocks: int, num_heads: int, num_layers: int) -> None:
        if not reply.ok:
            raise KVTransferError(f"prefill instance {address} refused the pull: {reply.error}")
        expected_shape = self._block_shape(num_heads, num_layers)
        expected_bytes = num_blocks * self._bytes_per_block_of(num_heads, num_layers)
        expected_dtype = str(self.kv_cache.dtype).removeprefix("torch.")
        if reply.shape != expected_shape or reply.num_bytes != expected_bytes or reply.dtype != expected_dtype:
            raise KVTransferError(
                f"prefill instance {address} offers blocks of {reply.shape} ({reply.num_bytes} bytes of "
                f"{reply.dtype}), "
                f"expected {expected_shape} ({expected_bytes} bytes of {expected_dtype})"
            )

    async def _connect(self, address: str) -> _Connection:
        ucxx = ucxx_for_running_loop()
        host, _, port = address.rpartition(":")
        return _Connection(await ucxx.create_endpoint(host, int(port)))

    async def _take_idle(self, address: str) -> _Connection | None:
        """The most recently used idle connection to ``address`` that P has not closed, nor
        is about to close for idleness; older ones are closed here."""
        connections = self._idle.get(address)
        fresh_after = time.monotonic() - self.idle_timeout_s / 2
        while connections:
            connection = connections.pop()
            if connection.endpoint.closed:
                continue
            if connection.idle_since < fresh_after:
                await abandon(connection.endpoint, [])
                continue
            return connection
        return None

    async def _put_idle(self, address: str, connection: _Connection) -> None:
        connections = self._idle.setdefault(address, [])
        if len(connections) < MAX_IDLE_CONNECTIONS_PER_PEER:
            connection.idle_since = time.monotonic()
            connections.append(connection)
        else:
            await abandon(connection.endpoint, [])


def _entry_shape(draft_kv: PromptDraftKV) -> list[int]:
    """One entry's shape on the wire: ``[num_layers, 2, num_kv_heads, head_dim]``."""
    num_layers, kinds, _, num_kv_heads, head_dim = draft_kv.kv.shape
    return [num_layers, kinds, num_kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class _HeadTransfer:
    """D: which of P's heads and layers a pull asks for (None: all) and where they land in this rank's."""

    source: list[int] | None  # [first, count] of P's heads
    target_start: int
    num_heads: int
    source_layers: list[int] | None = None  # [first, count] of P's layers
    target_layer_start: int = 0
    num_layers: int = 0

    @property
    def target_stop(self) -> int:
        return self.target_start + self.num_heads

    @property
    def target_layer_stop(self) -> int:
        return self.target_layer_start + self.num_layers


# (layer first, layer count, head first, head count) of a rank's own layers and heads.
_SpanKey = tuple[int, int, int, int]


def _span_key(request: PullRequest, whole: _SpanKey) -> _SpanKey:
    """What a pull asks for of the serving rank's cache, whose all is ``whole``."""
    layers = (request.layers[0], request.layers[1]) if request.layers is not None else whole[:2]
    heads = (request.heads[0], request.heads[1]) if request.heads is not None else whole[2:]
    return (*layers, *heads)


async def _then_copy(receive: Awaitable[object], staging: torch.Tensor, target: torch.Tensor) -> None:
    """A staged receive, then its heads copied into their place in the blocks."""
    await receive
    target.copy_(staging)
