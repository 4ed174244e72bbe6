"""Which block hashes an engine's prefix cache holds, as a log of changes a gateway can
follow (cache-aware routing, ``gateway/prefix_index.py``).

The block pool records every block it registers (``stored``) and every cached block it
evicts or forgets (``removed``) here, on the engine thread. A reader (the gRPC
``GetKVEvents`` call, on the server's thread) asks for what changed after the last
sequence number it saw, in the log's epoch:

1. same epoch, and every event after its cursor still in the log: the hashes whose state
   changed since then, each once with its state now (stored or removed), in the order of
   their latest events, and the new cursor;
2. otherwise (the instance restarted: a new epoch; or the reader fell so far behind that the
   bounded log dropped events it missed): a snapshot, every hash cached now, which replaces
   whatever the reader held.

The log keeps at most ``max_events`` events and a mirror of the cached hashes (at most the
pool's block count), so its memory is bounded whatever the readers do.

Readers that follow the log as it changes (``serving/kv_event_stream.py``, which pushes the
changes to subscribed gateways) add a listener: the step thread calls :meth:`KVEventLog.end_step`
after every step, which calls each listener once if that step logged anything. A step's
changes then travel as one batch, never a block at a time.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache_utils import BlockHash


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    epoch: int
    last_seq: int  # the newest event this batch covers: the reader's next cursor
    snapshot: bool  # True: ``stored`` is every hash cached now, and replaces the reader's view
    stored: list[BlockHash]
    removed: list[BlockHash]


class KVEventLog:
    """Thread-safe: the engine thread writes, any thread reads."""

    def __init__(self, max_events: int) -> None:
        if max_events < 1:
            raise ValueError(f"the KV event log needs room for at least one event, got {max_events}")
        # Random per process: a reader that saw another epoch missed a restart and resynchronises.
        self.epoch = secrets.randbits(63) or 1
        self._lock = threading.Lock()
        self._events: deque[tuple[int, BlockHash]] = deque(maxlen=max_events)  # (seq, hash)
        self._last_seq = 0
        self._cached: set[BlockHash] = set()
        self._listeners: list[Callable[[], None]] = []
        self._notified_seq = 0  # the newest event listeners were told of (step thread only)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq

    def add_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` is called on the step thread at the end of each step that logged an
        event; it must return at once (post to its own loop, never read or wait there)."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

    def end_step(self) -> None:
        """Called by the step thread after each step: tells the listeners once if it logged anything."""
        with self._lock:
            if self._last_seq == self._notified_seq:
                return
            self._notified_seq = self._last_seq
            listeners = self._listeners
        for listener in listeners:
            listener()

    def stored(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._cached.add(block_hash)
            self._append(block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._cached.discard(block_hash)
            self._append(block_hash)

    def read(self, epoch: int, after_seq: int) -> KVEventBatch:
        """What changed after ``after_seq`` of ``epoch`` (see the module docstring)."""
        with self._lock:
            oldest_kept = self._events[0][0] if self._events else self._last_seq + 1
            # Events after_seq+1 .. last_seq must all still be in the log.
            if (
                epoch != self.epoch
                or after_seq > self._last_seq
                or (after_seq < self._last_seq and after_seq + 1 < oldest_kept)
            ):
                return self._snapshot()
            # Each changed hash once, in the order of its latest event: the order a request's
            # blocks were stored in (its prompt's), which the gateway's eviction order follows.
            newest_first: dict[BlockHash, None] = {}
            for seq, block_hash in reversed(self._events):
                if seq <= after_seq:
                    break
                newest_first.setdefault(block_hash)
            changed = list(reversed(newest_first))
            stored = [h for h in changed if h in self._cached]
            removed = [h for h in changed if h not in self._cached]
            return KVEventBatch(self.epoch, self._last_seq, False, stored, removed)

    def snapshot(self) -> KVEventBatch:
        """Every hash cached now, whatever a reader's cursor (a reader paging one that must start over)."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> KVEventBatch:
        return KVEventBatch(self.epoch, self._last_seq, True, list(self._cached), [])

    def _append(self, block_hash: BlockHash) -> None:
        self._last_seq += 1
        self._events.append((self._last_seq, block_hash))
