"""The decode engine's KV loading: how a hand-off's prompt KV, computed elsewhere, gets into
the blocks this engine gave it (the shape of vLLM v1's connector worker side).

The engine decides *when* a load happens and what it may write; a :class:`KVLoader` decides
*how* (the decode service pulls through a KV connector; tests copy between two engines). The
engine imports no connector: this module is the whole contract. One hand-off, in call order:

1. Scheduler, when it admits the hand-off (on the engine's step thread, at a step boundary,
   or while a step computes if it arrived then and its blocks fit beside the running
   requests'): allocates its blocks, reusing local prefix-cache hits, and calls
   :meth:`KVLoader.start_load`.
   The request now waits for its KV (``WAITING_FOR_REMOTE_KV``).
2. Loader, wherever it does the copy: writes ``load.block_ids[load.num_local_hit_blocks:]``, then
   :meth:`KVLoader.report` hands over the outcome, which posts it to the engine's inbox
   (engine/inbox.py, ``KVLoadFinished``) and so wakes an idle engine.
3. Engine, at the next step boundary: hands the result to :meth:`Scheduler.kv_load_finished`. A
   loaded request joins the running ones and its blocks the prefix cache; a failed one
   recomputes its prompt here or ends with an error, as its :data:`KVLoadFailurePolicy` says.

Ownership of the blocks: from ``start_load`` until that request's result arrives, the
blocks are the loader's to write and nobody else's. A request aborted meanwhile is ended at
once, but its blocks stay allocated: the scheduler calls :meth:`KVLoader.cancel_load` and frees
them only when the load's result arrives, so no copy lands in a block that another
request already holds.

A loader may also report a failure for a hand-off whose load it was never asked to start (its
source is known to be gone, e.g. the prefill instance dropped the KV while the request queued
here): the scheduler then fails or recomputes the request without waiting for blocks.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the EAGLE modules are loaded only where a draft is
    from engine.spec_decode.prompt_draft_kv import PromptDraftKV

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
    # EAGLE: the draft's KV over the prompt, when the loader brought it with the blocks
    # (engine/spec_decode/prompt_draft_kv.py); None: the draft attends from the first step on.
    prompt_draft_kv: PromptDraftKV | None = None


class KVLoader(abc.ABC):
    """Fills hand-offs' blocks for a decode engine. Subclasses implement :meth:`start_load`
    and :meth:`cancel_load`; results go through :meth:`report`, from any thread."""

    def __init__(self) -> None:
        self._post: Callable[[KVLoadResult], None] | None = None

    def bind(self, post: Callable[[KVLoadResult], None]) -> None:
        """Called once by the engine that uses this loader, before its first step: ``post``
        (callable from any thread) hands a result to the engine for its next step boundary."""
        if self._post is not None:
            raise RuntimeError("bug: this KV loader already serves an engine")
        self._post = post

    @abc.abstractmethod
    def start_load(self, load: KVLoad) -> None:
        """Called by the scheduler on the engine's step thread, right after it allocated
        ``load.block_ids`` for the hand-off. Must return at once: the copy runs elsewhere and
        ends with exactly one :meth:`report` for ``load.request_id`` (unless a failure was
        already reported for it)."""

    @abc.abstractmethod
    def cancel_load(self, request_id: str) -> None:
        """Called by the scheduler (step thread) when a request whose load is in flight ends
        (aborted). Must return at once; stop writing into its blocks as soon as possible, and
        :meth:`report` the load (with an error) once nothing writes to them any more: the
        engine frees them then."""

    def report(self, result: KVLoadResult) -> None:
        """A load ended (or a hand-off's source is known gone). Any thread."""
        if self._post is None:
            raise RuntimeError(f"bug: the KV load of {result.request_id} ended on a loader no engine uses")
        self._post(result)
