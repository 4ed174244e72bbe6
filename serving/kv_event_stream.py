"""An instance's prefix-cache events pushed to subscribed gateways (``Load.WatchKVEvents``),
so that KV-event traffic follows the cache's changes instead of gateways x instances x a
poll rate. ``GetKVEvents`` (``serving/kv_event_pages.py``) stays the way to read a snapshot:
a subscriber that cannot be served from the log's recent events resynchronises through it.

In call order:

1. ``subscribe`` (the gRPC handler, event loop): the subscriber's first batch is what changed
   after its cursor, read from the log (``KVEventLog.read``) and queued at once; a cursor
   that needs a snapshot (another epoch, a gap the log no longer holds, more changes than
   the subscriber's page) queues a resync marker instead. Past ``max_subscribers`` the call
   is refused, as health ``Watch`` streams are (``cluster/health_watch.py``).
2. The step thread, at the end of a step that logged events, calls :meth:`KVEventStreams.notify`
   (a ``KVEventLog`` listener): it posts one :meth:`KVEventStreams.publish` to the event loop,
   none while one is still pending.
3. ``publish`` (event loop): one log read since the last one, built into one message and
   offered to every subscriber; a subscriber skips what its first batch already covered
   (the log reports each hash with its state now, so a batch that overlaps one already
   applied changes nothing).
4. The handler writes its subscriber's queue out. A subscriber whose queue would pass
   ``max_queued_hashes`` (its client reads slower than the cache changes, or not at all)
   has the queue dropped for a resync marker, and is offered nothing more: its memory stays
   one message; the stream ends after the marker, and at ``lifetime_s`` in any case.
5. A subscriber with nothing queued for ``heartbeat_s`` (the subscriber's ``heartbeat_ms``, or
   the instance's own interval) is handed an empty message, a heartbeat: the gateway ends a
   stream on which nothing at all came for a few of them (``gateway/kv_events.py``), which is
   how it tells a quiet cache from a host gone silent without closing the socket. Towards a
   gateway gone that way, the stream ends at ``lifetime_s`` (a write the peer's flow control
   holds included), and its queue is one message meanwhile.
6. The instance stopping calls :meth:`KVEventStreams.close`: every stream ends at once (OK),
   what is queued unsent, so that the server's drain, which waits for every open call, waits
   for requests alone; the gateway reads the instance's changes by poll from then on, if it
   still wants them (``gateway/kv_events.py``).

Event-loop only but ``notify``: no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_events import KVEventBatch, KVEventLog
from serving.kv_event_pages import DEFAULT_PAGE_HASHES
from splitserve.v1 import disaggregation_pb2

DEFAULT_MAX_SUBSCRIBERS = 64  # a subscription per gateway process: a few gateways of a few processes each
DEFAULT_MAX_QUEUED_HASHES = DEFAULT_PAGE_HASHES  # about a page (1.2 MB) per subscriber at most
DEFAULT_LIFETIME_S = 300.0  # as health Watch streams: the gateway subscribes again from its cursor
DEFAULT_HEARTBEAT_S = 5.0  # for a subscriber that asks for none (gateway/kv_events.py's default too)
MIN_HEARTBEAT_S = 0.05  # the most often a subscriber may ask for one: a heartbeat costs a write

ToMessage = Callable[[KVEventBatch], disaggregation_pb2.KVEvents]


class KVEventSubscriber:
    """One stream's queue: batches after ``cursor``, or a resync marker."""

    def __init__(
        self, cursor: int, page_hashes: int, max_queued_hashes: int, heartbeat_s: float = DEFAULT_HEARTBEAT_S
    ) -> None:
        self.cursor = cursor  # the newest event queued for this subscriber
        self.page_hashes = page_hashes
        self.max_queued_hashes = max_queued_hashes
        self.heartbeat_s = heartbeat_s  # how long get() waits for a batch before it hands out a heartbeat
        self.num_heartbeats = 0
        self.lagged = False  # a resync marker is queued; nothing more will be
        self.ended = False  # the instance is stopping: get() hands out nothing more
        self.num_queued_hashes = 0
        self._queue: deque[tuple[disaggregation_pb2.KVEvents, int]] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def first(self, message: disaggregation_pb2.KVEvents, num_hashes: int) -> None:
        """The changes after the subscriber's own cursor, up to ``cursor``."""
        if num_hashes > self.page_hashes:
            self.resync(message.epoch)
        else:
            self._put(message, num_hashes)

    def offer(self, message: disaggregation_pb2.KVEvents, num_hashes: int) -> None:
        """A published batch; skipped when the subscriber's queue already covers it."""
        if self.lagged or message.last_seq <= self.cursor:
            return
        if num_hashes > self.page_hashes or self.num_queued_hashes + num_hashes > self.max_queued_hashes:
            self.resync(message.epoch)
            return
        self.cursor = message.last_seq
        self._put(message, num_hashes)

    def _put(self, message: disaggregation_pb2.KVEvents, num_hashes: int) -> None:
        self._queue.append((message, num_hashes))
        self.num_queued_hashes += num_hashes
        self._ready.set()

    def resync(self, epoch: int) -> None:
        """Drop what is queued for one marker: the subscriber reads a snapshot instead."""
        self._queue.clear()
        self.num_queued_hashes = 0
        self.lagged = True
        self._queue.append((disaggregation_pb2.KVEvents(epoch=epoch, resync=True), 0))
        self._ready.set()

    def end(self) -> None:
        """End the stream: its next :meth:`get`, or the one waiting, returns None."""
        self.ended = True
        self._ready.set()

    async def get(self) -> disaggregation_pb2.KVEvents | None:
        """The next queued message, an empty one (a heartbeat) once ``heartbeat_s`` passed
        without one, or None once the stream has ended (:meth:`end`)."""
        while not self._queue and not self.ended:
            self._ready.clear()
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self._ready.wait()
            except TimeoutError:
                self.num_heartbeats += 1
                return disaggregation_pb2.KVEvents()
        if self.ended:
            return None
        message, num_hashes = self._queue.popleft()
        self.num_queued_hashes -= num_hashes
        return message


@dataclass(frozen=True, slots=True)
class KVEventStreamLimits:
    page_hashes: int = DEFAULT_PAGE_HASHES  # the most hashes in one message
    max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS
    max_queued_hashes: int = DEFAULT_MAX_QUEUED_HASHES  # per subscriber, unsent
    lifetime_s: float = DEFAULT_LIFETIME_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # for a subscriber that asks for no interval of its own

    def __post_init__(self) -> None:
        if self.heartbeat_s < MIN_HEARTBEAT_S:
            raise ValueError(f"a heartbeat interval must be at least {MIN_HEARTBEAT_S} s, got {self.heartbeat_s}")
        if self.page_hashes < 1 or self.max_queued_hashes < self.page_hashes:
            raise ValueError(
                f"a subscriber's queue must hold at least a page of hashes, got {self.max_queued_hashes} "
                f"for pages of {self.page_hashes}"
            )


class KVEventStreams:
    def __init__(self, log: KVEventLog, to_message: ToMessage, limits: KVEventStreamLimits) -> None:
        """Built on the event loop it serves from; listens to ``log`` from then on."""
        self.log = log
        self.to_message = to_message
        self.limits = limits
        self.subscribers: set[KVEventSubscriber] = set()
        self.num_published = 0  # batches built (one per step that changed the cache, while subscribed)
        self._loop = asyncio.get_running_loop()
        self._cursor = log.last_seq  # published up to here
        self._pending = False  # a publish is posted and has not run yet
        log.add_listener(self.notify)

    def subscribe(
        self, epoch: int, after_seq: int, max_hashes: int = 0, heartbeat_ms: int = 0
    ) -> KVEventSubscriber | None:
        """A subscriber after the cursor, its first batch (or a resync marker) queued; None
        past ``max_subscribers``. ``heartbeat_ms``: the subscriber's heartbeat interval, 0 for
        the instance's (``limits.heartbeat_s``), never under ``MIN_HEARTBEAT_S``."""
        limits = self.limits
        if len(self.subscribers) >= limits.max_subscribers:
            return None
        page_hashes = min(max_hashes, limits.page_hashes) if max_hashes > 0 else limits.page_hashes
        heartbeat_s = max(heartbeat_ms / 1000, MIN_HEARTBEAT_S) if heartbeat_ms > 0 else limits.heartbeat_s
        batch = self.log.read(epoch, after_seq)
        subscriber = KVEventSubscriber(batch.last_seq, page_hashes, limits.max_queued_hashes, heartbeat_s)
        if batch.snapshot:
            subscriber.resync(batch.epoch)
        elif batch.stored or batch.removed:
            subscriber.first(self.to_message(batch), len(batch.stored) + len(batch.removed))
        self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: KVEventSubscriber) -> None:
        self.subscribers.discard(subscriber)

    def close(self) -> None:
        """The instance is stopping: end every stream (step 6 of the module docstring)."""
        for subscriber in self.subscribers:
            subscriber.end()

    def notify(self) -> None:
        """The step thread: the log changed during a step (a ``KVEventLog`` listener)."""
        if not self._pending:
            self._pending = True
            # RuntimeError: the loop has closed (the server is gone): nobody to push to.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.publish)

    def publish(self) -> None:
        """What the log gained since the last publish, as one batch to every subscriber."""
        self._pending = False  # before the read: a step ending from now on posts another
        if not self.subscribers:
            self._cursor = self.log.last_seq
            return
        batch = self.log.read(self.log.epoch, self._cursor)
        self._cursor = batch.last_seq
        if batch.snapshot:  # the log dropped events never published: nobody can follow from here
            for subscriber in self.subscribers:
                subscriber.resync(batch.epoch)
            return
        if not batch.stored and not batch.removed:
            return
        message = self.to_message(batch)
        self.num_published += 1
        num_hashes = len(batch.stored) + len(batch.removed)
        for subscriber in self.subscribers:
            subscriber.offer(message, num_hashes)
