"""P's KV leases on their own, with a recording connector and engine: each path (release,
abort, expiry, shutdown) frees a request's blocks exactly once, unpublishing before the
engine frees them; renewals restart the lease and name the ids not pinned here; a publish
that takes long leaves the event loop to the control calls, and an abort meanwhile leaves
no handle to hand out."""

from __future__ import annotations

import asyncio

import pytest

from kv_connector.base import PublishedKV
from prefill_svc.leases import KVLeases
from serving.instance import ServiceCounters

DIGESTS = (bytes(32),)


class Recorder:
    """The connector and the engine as the leases call them, in one ordered log. A publish
    waits for :attr:`stored` when :attr:`slow` (a slow store), and unpublish for the publish."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.slow = False
        self.publishing = asyncio.Event()
        self.stored = asyncio.Event()
        self._published: asyncio.Event | None = None

    async def publish(
        self, request_id: str, block_ids: list[int], token_ids: list[int], pull_token: bytes, cache_salt: str
    ) -> PublishedKV:
        self.calls.append(("publish", request_id))
        self.publishing.set()
        published = self._published = asyncio.Event()

        async def store() -> PublishedKV:  # goes on if the caller gives up, as a store's thread does
            if self.slow:
                await self.stored.wait()
            self.calls.append(("published", request_id))
            published.set()
            return PublishedKV(chunk_digests=DIGESTS)

        return await asyncio.shield(asyncio.ensure_future(store()))

    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
        if self._published is not None:
            await self._published.wait()  # as a connector does: the publish stops copying first
        await asyncio.sleep(0)  # a pull may still be reading: the engine must wait for this
        self.calls.append((f"unpublish grace={grace_s}", request_id))

    def release_kv(self, request_id: str) -> None:
        self.calls.append(("release_kv", request_id))


def make_leases(lease_s: float = 60.0) -> tuple[KVLeases, Recorder, ServiceCounters]:
    recorder, counters = Recorder(), ServiceCounters()
    return KVLeases(recorder, recorder, lease_s, counters), recorder, counters  # type: ignore[arg-type]


def test_unpin_frees_once_unpublishing_before_the_engine_frees() -> None:
    async def scenario() -> None:
        leases, recorder, _ = make_leases()
        assert await leases.pin("r", [1, 2], [5, 6, 7], b"token", "") == PublishedKV(DIGESTS)
        assert "r" in leases
        assert leases.unpin("r", grace_s=5.0) and not leases.unpin("r", grace_s=0.0)
        assert "r" not in leases
        await leases.close()
        assert recorder.calls == [
            ("publish", "r"),
            ("published", "r"),
            ("unpublish grace=5.0", "r"),
            ("release_kv", "r"),
        ]

    asyncio.run(scenario())


def test_renew_restarts_the_lease_and_names_unknown_ids() -> None:
    async def scenario() -> None:
        leases, recorder, counters = make_leases(lease_s=1.0)
        await leases.pin("r", [1], [5], b"token", "")
        for _ in range(3):  # past the first lease, renewed well within each
            await asyncio.sleep(0.4)
            assert leases.renew(["r", "gone"]) == ["gone"]
        assert "r" in leases and counters.num_lease_renewals == 3 and counters.num_lease_expiries == 0
        await asyncio.sleep(1.5)  # no renewal: it expires
        assert "r" not in leases and counters.num_lease_expiries == 1
        await leases.close()
        assert recorder.calls == [
            ("publish", "r"),
            ("published", "r"),
            ("unpublish grace=0.0", "r"),
            ("release_kv", "r"),
        ]

    asyncio.run(scenario())


def test_close_frees_what_is_still_pinned() -> None:
    async def scenario() -> None:
        leases, recorder, counters = make_leases()
        await leases.pin("a", [1], [5], b"token", "")
        await leases.pin("b", [2], [6], b"token", "")
        await leases.close()
        assert sorted(call for call in recorder.calls if call[0] == "release_kv") == [
            ("release_kv", "a"),
            ("release_kv", "b"),
        ]
        assert "a" not in leases and "b" not in leases and counters.num_lease_expiries == 0

    asyncio.run(scenario())


def test_a_slow_publish_leaves_the_event_loop_to_renewals() -> None:
    """The lease exists from the moment the publish starts: RenewKV knows the request while the
    store still takes its time, and the handle's digests come back once it is done."""

    async def scenario() -> None:
        leases, recorder, counters = make_leases()
        recorder.slow = True
        pinning = asyncio.create_task(leases.pin("r", [1], [5], b"token", "salt"))
        await recorder.publishing.wait()
        assert leases.renew(["r", "x"]) == ["x"] and counters.num_lease_renewals == 1
        assert not pinning.done()
        recorder.stored.set()
        assert await pinning == PublishedKV(DIGESTS) and "r" in leases
        await leases.close()

    asyncio.run(scenario())


def test_an_abort_during_the_publish_frees_after_it_and_hands_out_nothing() -> None:
    async def scenario() -> None:
        leases, recorder, _ = make_leases()
        recorder.slow = True
        pinning = asyncio.create_task(leases.pin("r", [1], [5], b"token", ""))
        await recorder.publishing.wait()
        assert leases.unpin("r", grace_s=0.0)  # Abort
        recorder.stored.set()
        assert await pinning is None  # no handle may go out for blocks being freed
        await leases.close()
        assert recorder.calls == [
            ("publish", "r"),
            ("published", "r"),
            ("unpublish grace=0.0", "r"),
            ("release_kv", "r"),
        ]

    asyncio.run(scenario())


def test_a_prefill_call_cancelled_during_the_publish_unpins() -> None:
    async def scenario() -> None:
        leases, recorder, _ = make_leases()
        recorder.slow = True
        pinning = asyncio.create_task(leases.pin("r", [1], [5], b"token", ""))
        await recorder.publishing.wait()
        pinning.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pinning
        assert "r" not in leases
        recorder.stored.set()
        await leases.close()
        assert ("release_kv", "r") in recorder.calls

    asyncio.run(scenario())
