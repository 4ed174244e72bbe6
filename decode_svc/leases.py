"""The decode side of the prefill instances' KV leases.

P keeps a request's prompt KV pinned under a lease; D holds the handle from the
moment its Decode call arrives until the pull is over (or the call ends). While
D holds it — the request queued behind others, or its pull in flight — D renews
the lease, batched per P, every third of the lease, so the blocks expire only
when D is gone or silent. Once D no longer needs them it releases them. A P that
answers a renewal with "unknown" has freed the blocks (released, aborted,
expired, restarted): D learns the KV is lost before trying to pull it.

With tracing on, each renewal P confirms is an event ("kv lease renewed") on the span
of the Decode call that holds the handle (``serving/request_timing.py``); with tracing
off a handle has no span and a renewal costs nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from cluster.background import BackgroundTasks
from cluster.internal_grpc import InternalPlane
from cluster.prefill_control import release_kv, renew_kv
from serving.request_timing import CallSpans

logger = logging.getLogger(__name__)

RENEW_TICK_S = 0.25  # how often due renewals are looked for
RENEW_FRACTION = 1 / 3  # of the lease: renew this long after the last renewal


@dataclass(slots=True, eq=False)
class HeldKV:
    prefill_request_id: str  # P's id for the pinned blocks
    prefill_address: str  # P's gRPC endpoint
    lease_s: float
    renewed_at: float  # monotonic
    spans: CallSpans | None = None  # the holding call's, with tracing on


class LeaseKeeper:
    """The handles this decode instance holds, by decode request id.

    ``on_lost(decode_request_id, reason)`` is called on the event loop when P says it
    no longer holds a handle's blocks; the handle is dropped by then.
    """

    def __init__(self, on_lost: Callable[[str, str], None], plane: InternalPlane | None = None) -> None:
        """``plane``: how channels to prefill instances are secured (default: open)."""
        self._on_lost = on_lost
        self._plane = plane or InternalPlane()
        self._held: dict[str, HeldKV] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background = BackgroundTasks()
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._renew_forever())

    def hold(
        self,
        decode_request_id: str,
        prefill_request_id: str,
        prefill_address: str,
        lease_s: float,
        spans: CallSpans | None = None,
    ) -> None:
        """Called when a Decode call arrives with a handle (the lease started on P just before);
        ``spans``: the call's, to record the renewals on (None: tracing is off)."""
        self._held[decode_request_id] = HeldKV(prefill_request_id, prefill_address, lease_s, time.monotonic(), spans)

    def release(self, decode_request_id: str) -> None:
        """D is done with the blocks (pulled, failed, or the call ended): P may free them now.
        Idempotent; the ReleaseKV call runs in the background and outlives the request."""
        held = self._held.pop(decode_request_id, None)
        if held is not None and held.prefill_address:
            channel = self._channel(held.prefill_address)
            self._background.spawn(release_kv(channel, held.prefill_request_id, held.prefill_address))

    def __contains__(self, decode_request_id: str) -> bool:
        return decode_request_id in self._held

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        await self._background.wait()
        for channel in self._channels.values():
            await channel.close()

    # ------------------------------------------------------------ renewal

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_TICK_S)
            self._renew_due()

    def _renew_due(self) -> None:
        now = time.monotonic()
        due: dict[str, list[tuple[str, HeldKV]]] = defaultdict(list)
        for decode_request_id, held in self._held.items():
            if held.prefill_address and held.lease_s > 0 and now - held.renewed_at >= held.lease_s * RENEW_FRACTION:
                held.renewed_at = now  # in flight: not due again until a third of a lease later
                due[held.prefill_address].append((decode_request_id, held))
        for address, batch in due.items():
            self._background.spawn(self._renew(address, batch))

    async def _renew(self, address: str, batch: list[tuple[str, HeldKV]]) -> None:
        timeout_s = min(held.lease_s for _, held in batch) * RENEW_FRACTION
        unknown = await renew_kv(
            self._channel(address), [held.prefill_request_id for _, held in batch], address, timeout_s
        )
        if unknown is None:
            return  # P did not answer; the next tick tries again, and a pull would fail clearly
        lost = set(unknown)
        for decode_request_id, held in batch:
            if held.prefill_request_id not in lost:
                if held.spans is not None:
                    held.spans.kv_lease_renewed(address, held.prefill_request_id, held.lease_s)
            elif self._held.get(decode_request_id) is held:
                del self._held[decode_request_id]
                self._on_lost(
                    decode_request_id,
                    f"prefill instance {address} no longer holds the KV of {held.prefill_request_id!r}",
                )

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._plane.channel(address)
        return channel
