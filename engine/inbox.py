"""The engine's one input queue: every change to engine state that starts outside the step
thread arrives here as a typed message, and the step thread applies it at a step boundary.

Messages (frozen: they cross threads and are never changed after :meth:`EngineInbox.put`):

- :class:`AddRequest`: a request to schedule (a decode hand-off carries P's first token);
- :class:`AbortRequests`: end requests now and free their blocks;
- :class:`ReleaseKV`: prefill role, the decode side has the KV; unpin its blocks;
- :class:`KVLoadFinished`: decode role, the KV loader finished (or failed) a hand-off's load.

Any thread puts; only the step thread takes (:meth:`EngineInbox.take`). A put also wakes a
step thread that idles with nothing to step, or waits for a decode engine's model thread: a
hand-off's add is applied then, while the step computes (engine/engine_core.py), and the
other messages wait for the boundary.

The inbox also counts what the adds queued in it will cost, for the load report: a prefill
step can take seconds, and a request waiting here behind it is work the instance has, which
routing must see. The counts drop only after the step thread has applied the adds and published
a report that holds them (:meth:`EngineInbox.applied`), so a reader may count a request twice
for a moment, never zero times.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from engine.kv_loader import KVLoadFailurePolicy, KVLoadResult
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    # Decode role: the prompt was prefilled elsewhere, this is P's sampled token, and the
    # prompt's KV is loaded here; what happens when it cannot be is ``kv_load_failure_policy``.
    first_token_id: int | None = None
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    # Decode role, Medusa: the drafts P's heads proposed after the first token (KVHandoff's).
    draft_token_ids: list[int] | None = None
    # Prompt tokens this instance will prefill (net of the prefix cache, estimated at put;
    # 0 for a hand-off): what the load report counts while the add waits here.
    num_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    request_id: str


@dataclass(frozen=True, slots=True)
class KVLoadFinished:
    result: KVLoadResult


EngineMessage = AddRequest | AbortRequests | ReleaseKV | KVLoadFinished


class EngineInbox:
    """Thread-safe; one consumer (the step thread)."""

    def __init__(self) -> None:
        self._messages: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._counts_lock = threading.Lock()
        self._num_adds = 0
        self._num_prefill_tokens = 0

    def put(self, message: EngineMessage) -> None:
        """Any thread: queue ``message`` for the next step boundary and wake the step thread."""
        if isinstance(message, AddRequest):
            with self._counts_lock:
                self._num_adds += 1
                self._num_prefill_tokens += message.num_prefill_tokens
        self._messages.put(message)
        self._wakeup.set()

    def take(self) -> list[EngineMessage]:
        """Step thread: every message queued so far, in the order they were put."""
        messages: list[EngineMessage] = []
        while True:
            try:
                messages.append(self._messages.get_nowait())
            except queue.Empty:
                return messages

    def applied(self, messages: list[EngineMessage]) -> None:
        """Step thread, once ``messages`` are applied and a load report holding them published:
        their adds stop counting as queued."""
        adds = [message for message in messages if isinstance(message, AddRequest)]
        if adds:
            with self._counts_lock:
                self._num_adds -= len(adds)
                self._num_prefill_tokens -= sum(add.num_prefill_tokens for add in adds)

    def queued_adds(self) -> tuple[int, int]:
        """Any thread: (requests, prompt tokens to prefill) queued and not yet applied."""
        with self._counts_lock:
            return self._num_adds, self._num_prefill_tokens

    def __bool__(self) -> bool:
        """Anything queued (a hint: a message may arrive right after it answers False)."""
        return not self._messages.empty()

    # ------------------------------------------------------------ the step thread's wake-ups

    def clear_wakeup(self) -> None:
        """Step thread, before it looks for work: a put from then on is never missed."""
        self._wakeup.clear()

    def wait(self, timeout_s: float) -> None:
        """Step thread, idle: until something is put (or :meth:`wake`), at most ``timeout_s``."""
        self._wakeup.wait(timeout_s)

    def wake(self) -> None:
        """Any thread: end the step thread's :meth:`wait` without a message (to stop it)."""
        self._wakeup.set()
