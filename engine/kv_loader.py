"""The decode engine's KV loading: how a hand-off's prompt KV, computed elsewhere, gets into
the blocks this engine gave it (the shape of vLLM v1's connector worker side).

The engine decides *when* a load happens and what it may write; a :class:`KVLoader` decides
*how* (the decode service pulls through a KV connector; tests copy between two engines). The
engine imports no connector: this module is the whole contract. One hand-off, in call order:

1. Scheduler, when it admits the hand-off (at a step boundary on the engine thread, or inside
   the hand-off window while a step computes, on the thread that brought the hand-off):
   allocates its blocks, reusing local prefix-cache hits, and calls :meth:`KVLoader.start_load`.
   The request now waits for its KV (``WAITING_FOR_REMOTE_KV``).
2. Loader, wherever it does the copy: writes ``load.block_ids[load.num_local_hit_blocks:]``, then
   :meth:`KVLoader.report`\\ s the outcome, which wakes an idle engine.
3. Scheduler, at the next step boundary: :meth:`KVLoader.poll_finished`. A loaded request joins
   the running ones and its blocks the prefix cache; a failed one recomputes its prompt here or
   ends with an error, as its :data:`KVLoadFailurePolicy` says.

Ownership of the blocks: from ``start_load`` until the poll returns that request's result, the
blocks are the loader's to write and nobody else's. A request aborted meanwhile is ended at
once, but its blocks stay allocated: the scheduler calls :meth:`KVLoader.cancel_load` and frees
them only when the poll returns the load's result, so no copy lands in a block that another
request already holds.

A loader may also report a failure for a hand-off whose load it was never asked to start (its
source is known to be gone, e.g. the prefill instance dropped the KV while the request queued
here): the scheduler then fails or recomputes the request without waiting for blocks.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# What a request does when its KV cannot be loaded: compute its prompt here instead (in chunks
# within the step budget), or end with finish reason "error" so that the caller can prefill it
# again elsewhere (vLLM's kv_load_failure_policy, chosen per request here).
KVLoadFailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True, slots=True)
class KVLoad:
    """A hand-off's blocks, allocated, for the loader to fill with its prompt's KV."""

    request_id: str
    block_ids: list[int]  # all of the prompt's blocks, local ids, in prompt order
    num_local_hit_blocks: int  # leading blocks already holding the KV, from the local prefix cache: not loaded


@dataclass(frozen=True, slots=True)
class KVLoadResult:
    """How a load ended. ``error`` None: the blocks hold the KV; otherwise why they do not
    (failed, cancelled, or the source is gone) and nothing writes into them any more."""

    request_id: str
    error: str | None = None


def _no_wake() -> None:
    """The default wake: an engine stepped by hand (offline, tests) polls on its next step anyway."""


class KVLoader(abc.ABC):
    """Fills hand-offs' blocks for a decode engine. Subclasses implement :meth:`start_load`
    and :meth:`cancel_load`; results go through :meth:`report`, from any thread."""

    def __init__(self) -> None:
        # deque append and popleft are atomic: report() may run on any thread, the poll on the engine's.
        self._finished: collections.deque[KVLoadResult] = collections.deque()
        self._wake: Callable[[], None] = _no_wake

    def bind(self, wake: Callable[[], None]) -> None:
        """Called once by the engine that uses this loader, before its first step: ``wake``
        (callable from any thread) makes an engine idling with only loads in flight poll now."""
        self._wake = wake

    @abc.abstractmethod
    def start_load(self, load: KVLoad) -> None:
        """Called by the scheduler right after it allocated ``load.block_ids`` for the
        hand-off, on the engine thread or inside the hand-off window (another thread, while a
        step computes). Must return at once: the copy runs elsewhere and ends with exactly one
        :meth:`report` for ``load.request_id`` (unless a failure was already reported for it)."""

    @abc.abstractmethod
    def cancel_load(self, request_id: str) -> None:
        """Called by the scheduler (engine thread) when a request whose load is in flight ends
        (aborted). Must return at once; stop writing into its blocks as soon as possible, and
        :meth:`report` the load (with an error) once nothing writes to them any more: the
        engine frees them then."""

    def report(self, result: KVLoadResult) -> None:
        """A load ended (or a hand-off's source is known gone). Any thread."""
        self._finished.append(result)
        self._wake()

    def poll_finished(self) -> list[KVLoadResult]:
        """Called by the scheduler at each step boundary (engine thread): the results reported
        since the last poll, in report order."""
        finished: list[KVLoadResult] = []
        while self._finished:
            finished.append(self._finished.popleft())
        return finished
