"""The decode service's KV loader: it fills a hand-off's blocks by pulling them from the
prefill instance that holds them, through the KV connector, while the lease keeper keeps
that instance's lease alive (engine/kv_loader.py has the engine's side of the contract).

One hand-off, in call order (the engine's steps in brackets):

1. ``expect`` (event loop, the Decode call, before the engine has the request): hold the
   handle; :class:`~decode_svc.leases.LeaseKeeper` renews P's lease from now on (each
   renewal an event of the call's span, with tracing on).
2. [The scheduler admits the request, while a step computes or at a step boundary, and calls
   ``start_load`` on the engine's step thread.] ``start_load`` hands the load to the event loop; there ``_start``
   begins ``_pull``, or reports a failure at once when P no longer holds the KV.
3. ``_pull`` (event loop): ``connector.pull(source, block_ids, num_local_hit_blocks, timeout_s)``
   copies P's blocks ``num_local_hit_blocks:`` into the request's (with an EAGLE draft and a
   connector that carries it, ``pull_with_draft_kv`` also brings the draft's KV over the prompt
   in the same pull, whatever the local hits: kv_connector/draft_kv.py); then ``report`` (which
   posts the result, draft KV included, to the engine's inbox and wakes it) and
   ``leases.release`` (ReleaseKV to P, in the background), success or not. [The engine applies
   the result at its next step boundary.]
4. ``outcome`` (event loop, the Decode call, at its first output): how the KV came.
5. ``forget`` (event loop, the Decode call ends): release the lease if still held.

P dropping the KV while the request still queues here (the lease keeper's renewal says so)
is reported as a failed load at once, so the engine need not wait for blocks to learn it. A
request aborted during its pull: [the scheduler calls ``cancel_load``] the pull is cancelled
and reported, and only then does the engine free the blocks it was writing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from decode_svc.leases import LeaseKeeper
from engine.kv_loader import KVLoad, KVLoader, KVLoadResult
from engine.spec_decode.eagle_draft import new_draft_kv
from engine.spec_decode.prompt_draft_kv import DraftKVShape, PromptDraftKV
from kv_connector.base import KVSource, KVTransferError, TransferStats
from kv_connector.draft_kv import DraftKVCarrier
from serving.instance import Instance
from serving.request_timing import CallSpans

logger = logging.getLogger(__name__)

CANCELLED = "the request ended during its KV pull"


@dataclass(frozen=True, slots=True)
class KVLoadOutcome:
    """How a request's KV came: pulled (``stats``), or not (``error``); when the pull ran
    (``time.monotonic()``; both the moment it failed when it never started)."""

    num_local_hit_blocks: int
    started_at: float
    ended_at: float
    stats: TransferStats | None = None
    error: str | None = None


class RemoteKVLoader(KVLoader):
    """Pulls hand-offs' KV for one decode instance. Lives on the instance's event loop; the
    engine's calls (``start_load``, ``cancel_load``) may come from any thread."""

    def __init__(self, instance: Instance, pull_timeout_s: float) -> None:
        super().__init__()
        if instance.connector is None:
            raise ValueError("a decode instance needs a KV connector")
        self.instance = instance
        self.connector = instance.connector
        self.pull_timeout_s = pull_timeout_s
        self.draft_kv_shape = _draft_kv_shape(instance)
        self.leases = LeaseKeeper(on_lost=self._kv_lost, plane=instance.plane)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sources: dict[str, KVSource] = {}  # expected hand-offs, by decode request id
        self._pulls: dict[str, asyncio.Task[None]] = {}  # in flight
        self._outcomes: dict[str, KVLoadOutcome] = {}  # ended, until the call forgets them

    def start(self) -> None:
        """On the serving event loop, before the engine can start a load."""
        self._loop = asyncio.get_running_loop()
        self.leases.start()

    async def close(self) -> None:
        for pull in list(self._pulls.values()):
            pull.cancel()
        await asyncio.gather(*self._pulls.values(), return_exceptions=True)
        await self.leases.close()

    # ------------------------------------------------------------ the Decode call's side

    def expect(
        self, request_id: str, source: KVSource, prefill_address: str, lease_s: float, spans: CallSpans | None = None
    ) -> None:
        """A Decode call with this handle arrived: hold it (renewing P's lease) until pulled;
        ``spans``: the call's, which get the renewals (None: tracing is off)."""
        self._sources[request_id] = source
        self.leases.hold(request_id, source.request_id, prefill_address, lease_s, spans)

    def outcome(self, request_id: str) -> KVLoadOutcome | None:
        """How the request's KV came, once its load has ended."""
        return self._outcomes.get(request_id)

    def forget(self, request_id: str) -> None:
        """The Decode call ended: release P's blocks if not yet released, drop the records. A
        pull still in flight goes on until the engine cancels it (it frees the blocks after)."""
        self._sources.pop(request_id, None)
        self._outcomes.pop(request_id, None)
        self.leases.release(request_id)

    # ------------------------------------------------------------ the engine's side

    def start_load(self, load: KVLoad) -> None:
        self._event_loop.call_soon_threadsafe(self._start, load)

    def cancel_load(self, request_id: str) -> None:
        self._event_loop.call_soon_threadsafe(self._cancel, request_id)

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("bug: a KV load was asked of a loader that has not started")
        return self._loop

    # ------------------------------------------------------------ the event loop's side

    def _start(self, load: KVLoad) -> None:
        request_id = load.request_id
        if (outcome := self._outcomes.get(request_id)) is not None:
            # P dropped the KV while the request queued, and that was reported: again, in case
            # the report reached the engine before the request did (a repeat is ignored there).
            self.report(KVLoadResult(request_id, outcome.error))
            return
        source = self._sources.get(request_id)
        if source is None:
            self._fail(load, "the Decode call ended before its KV was pulled")
        elif request_id not in self.leases:
            self._fail(load, "the prefill instance no longer holds the KV")
        else:
            self._pulls[request_id] = asyncio.ensure_future(self._pull(load, source))

    def _cancel(self, request_id: str) -> None:
        pull = self._pulls.get(request_id)
        if pull is not None:
            pull.cancel()  # _pull reports once it has stopped writing
        # No pull in flight: its result was reported already (the engine frees on it).

    async def _pull(self, load: KVLoad, source: KVSource) -> None:
        request_id = load.request_id
        started_at = time.monotonic()
        error: str | None = "the KV pull stopped on an unexpected error (bug)"
        prompt_draft_kv: PromptDraftKV | None = None
        try:
            if self.draft_kv_shape is not None and isinstance(self.connector, DraftKVCarrier):
                stats, prompt_draft_kv = await self.connector.pull_with_draft_kv(
                    source, load.block_ids, load.num_local_hit_blocks, self.pull_timeout_s, self.draft_kv_shape
                )
            else:
                stats = await self.connector.pull(
                    source, load.block_ids, load.num_local_hit_blocks, self.pull_timeout_s
                )
        except KVTransferError as failure:
            error = str(failure)
            self.instance.counters.num_kv_pull_failures += 1
            logger.warning("KV pull for %s failed: %s", request_id, error)
        except asyncio.CancelledError:
            error = CANCELLED
            raise
        else:
            error = None
            self.instance.transfers.add(stats)
            self._outcomes[request_id] = KVLoadOutcome(
                load.num_local_hit_blocks, started_at, time.monotonic(), stats=stats
            )
            logger.info(
                "pulled %d blocks (%d bytes, %d messages) for %s in %.4f s",
                stats.num_blocks,
                stats.num_bytes,
                stats.num_messages,
                request_id,
                stats.seconds,
            )
        finally:
            del self._pulls[request_id]
            if error is not None:
                self._outcomes[request_id] = KVLoadOutcome(
                    load.num_local_hit_blocks, started_at, time.monotonic(), error=error
                )
            self.leases.release(request_id)
            self.report(KVLoadResult(request_id, error, prompt_draft_kv if error is None else None))

    def _fail(self, load: KVLoad, reason: str) -> None:
        self.instance.counters.num_kv_pull_failures += 1
        now = time.monotonic()
        self._outcomes[load.request_id] = KVLoadOutcome(load.num_local_hit_blocks, now, now, error=reason)
        self.leases.release(load.request_id)
        self.report(KVLoadResult(load.request_id, reason))

    def _kv_lost(self, request_id: str, reason: str) -> None:
        """The lease keeper learned that P no longer holds a handle's KV. A request still
        queued here fails its load now (the engine hands it back or recomputes); one whose
        pull is in flight learns it from the pull."""
        if request_id in self._sources and request_id not in self._pulls and request_id not in self._outcomes:
            now = time.monotonic()
            self._outcomes[request_id] = KVLoadOutcome(0, now, now, error=reason)
            self.report(KVLoadResult(request_id, reason))


def _draft_kv_shape(instance: Instance) -> DraftKVShape | None:
    """The shape of the draft KV this instance's pulls ask for: its EAGLE or EAGLE-3 draft's, or None."""
    eagle = instance.engine.core.runner.eagle
    if eagle is None:
        return None
    return DraftKVShape.of(new_draft_kv(eagle.draft, 0, capacity=1))
