"""P's KV leases on their own, with a recording connector and engine: each path (release,
abort, expiry, shutdown) frees a request's blocks exactly once, unpublishing before the
engine frees them; renewals restart the lease and name the ids not pinned here."""

from __future__ import annotations

import asyncio

from prefill_svc.leases import KVLeases
from serving.instance import ServiceCounters


class Recorder:
    """The connector and the engine as the leases call them, in one ordered log."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def publish(self, request_id: str, block_ids: list[int], token_ids: list[int], pull_token: bytes) -> None:
        self.calls.append(("publish", request_id))

    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
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
        leases.pin("r", [1, 2], [5, 6, 7], b"token")
        assert "r" in leases
        assert leases.unpin("r", grace_s=5.0) and not leases.unpin("r", grace_s=0.0)
        assert "r" not in leases
        await leases.close()
        assert recorder.calls == [("publish", "r"), ("unpublish grace=5.0", "r"), ("release_kv", "r")]

    asyncio.run(scenario())


def test_renew_restarts_the_lease_and_names_unknown_ids() -> None:
    async def scenario() -> None:
        leases, recorder, counters = make_leases(lease_s=1.0)
        leases.pin("r", [1], [5], b"token")
        for _ in range(3):  # past the first lease, renewed well within each
            await asyncio.sleep(0.4)
            assert leases.renew(["r", "gone"]) == ["gone"]
        assert "r" in leases and counters.num_lease_renewals == 3 and counters.num_lease_expiries == 0
        await asyncio.sleep(1.5)  # no renewal: it expires
        assert "r" not in leases and counters.num_lease_expiries == 1
        await leases.close()
        assert recorder.calls == [("publish", "r"), ("unpublish grace=0.0", "r"), ("release_kv", "r")]

    asyncio.run(scenario())


def test_close_frees_what_is_still_pinned() -> None:
    async def scenario() -> None:
        leases, recorder, counters = make_leases()
        leases.pin("a", [1], [5], b"token")
        leases.pin("b", [2], [6], b"token")
        await leases.close()
        assert sorted(call for call in recorder.calls if call[0] == "release_kv") == [
            ("release_kv", "a"),
            ("release_kv", "b"),
        ]
        assert "a" not in leases and "b" not in leases and counters.num_lease_expiries == 0

    asyncio.run(scenario())
