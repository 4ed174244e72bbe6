"""Prefix-cache events too large for one gRPC message (4 MiB by default: some 230,000 hashes)
travel in pages (serving/kv_event_pages.py) and reach the gateway's index whole
(gateway/kv_events.py), a snapshot that changed while it was paged made right by the next
poll; a call the instance refuses is logged as an error, once.

The pager alone, then a real gRPC server (the instance's own ``LoadServicer``, over an event
log filled here) polled by the gateway's ``KVEventsSync`` with gRPC's default limits."""

from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace

import grpc
import pytest

from engine.kv_cache_utils import BlockHash
from engine.kv_events import KVEventLog
from gateway.instances import InstancePool
from gateway.kv_events import KVEventsSync
from serving.instance import LoadServicer
from serving.kv_event_pages import DEFAULT_PAGE_HASHES, KVEventPages
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

NUM_HASHES = 300_000  # 300,000 x 18 bytes: 5.4 MB as one message
GRPC_DEFAULT_MAX_MESSAGE = 4 << 20


def filled_log(num_hashes: int, seed: int = 0) -> tuple[KVEventLog, list[BlockHash]]:
    rng = random.Random(seed)
    log = KVEventLog(max_events=4 * num_hashes + 1024)
    hashes = [BlockHash(rng.getrandbits(128)) for _ in range(num_hashes)]
    for block_hash in hashes:
        log.stored(block_hash)
    return log, hashes


# ------------------------------------------------------------------------------ the pager


def test_a_snapshot_larger_than_a_page_comes_in_pages_of_one_moment() -> None:
    log, hashes = filled_log(10)
    pages = KVEventPages(log, page_hashes=4)
    first = pages.read(0, 0)
    assert (first.snapshot, first.snapshot_offset, first.more, len(first.stored)) == (True, 0, True, 4)
    log.stored(BlockHash(1))  # after the snapshot's moment: not in it
    received = list(first.stored)
    while True:
        page = pages.read(first.epoch, first.last_seq, snapshot_offset=len(received))
        assert (page.last_seq, page.snapshot_offset) == (first.last_seq, len(received))
        received += page.stored
        if not page.more:
            break
    assert sorted(received) == sorted(hashes)
    # Done: the next read from the snapshot's cursor is the change made meanwhile.
    after = pages.read(first.epoch, first.last_seq)
    assert (after.snapshot, after.stored, after.removed) == (False, [BlockHash(1)], [])


def test_more_changes_than_a_page_become_a_paged_snapshot_and_a_dropped_one_starts_over() -> None:
    log, hashes = filled_log(6)
    pages = KVEventPages(log, page_hashes=4, max_held=1)
    cursor = pages.read(0, 0, max_hashes=100)  # the caller may ask for less than the page, never more
    assert (cursor.snapshot, cursor.more, len(cursor.stored)) == (True, True, 4)
    cursor = pages.read(cursor.epoch, cursor.last_seq, snapshot_offset=4)
    assert not cursor.more
    for block_hash in hashes[:5]:
        log.removed(block_hash)
    changed = pages.read(cursor.epoch, cursor.last_seq, max_hashes=3)  # 5 changes: over the caller's page
    assert (changed.snapshot, sorted(changed.stored), changed.more) == (True, sorted(hashes[5:]), False)
    for block_hash in hashes[:5]:
        log.stored(block_hash)
    a = pages.read(0, 0, max_hashes=2)
    b = pages.read(0, 0, max_hashes=2)  # a later moment? the same one: nothing changed; held once
    assert a.last_seq == b.last_seq and a.more
    log.stored(BlockHash(2))
    pages.read(0, 0, max_hashes=2)  # a newer snapshot pushes a's out (max_held=1)
    again = pages.read(a.epoch, a.last_seq, snapshot_offset=2, max_hashes=2)
    assert (again.snapshot_offset, again.last_seq) == (0, log.read(a.epoch, a.last_seq).last_seq)


# ---------------------------------------------------------------- through gRPC, to the index


def fake_instance(log: KVEventLog) -> SimpleNamespace:
    """What LoadServicer.GetKVEvents reads of an instance."""
    hasher = SimpleNamespace(name="xxh3")
    core = SimpleNamespace(kv_events=log, kv_cache_manager=SimpleNamespace(block_hasher=hasher))
    return SimpleNamespace(engine=SimpleNamespace(core=core), fingerprint=SimpleNamespace(block_size=16))


class RecordingServicer(LoadServicer):
    """The instance's servicer, keeping every answer's size; ``after_first`` runs once, after
    the first page of a paged snapshot went out."""

    def __init__(self, log: KVEventLog, after_first=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(fake_instance(log))  # type: ignore[arg-type]
        self.after_first = after_first
        self.sizes: list[int] = []

    async def GetKVEvents(self, request, context):  # noqa: N802 - gRPC signature
        reply = await super().GetKVEvents(request, context)
        self.sizes.append(reply.ByteSize())
        if reply.more and self.after_first is not None:
            self.after_first()
            self.after_first = None
        return reply


class OneMessageServicer(disaggregation_pb2_grpc.LoadServicer):
    """An instance from before paging: every hash in one message, until ``upgraded``."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self.upgraded: LoadServicer | None = None

    async def GetKVEvents(self, request, context):  # noqa: N802 - gRPC signature
        if self.upgraded is not None:
            return await self.upgraded.GetKVEvents(request, context)
        batch = self.log.read(request.epoch, request.after_seq)
        return disaggregation_pb2.KVEvents(
            epoch=batch.epoch,
            last_seq=batch.last_seq,
            snapshot=batch.snapshot,
            stored=[h.to_bytes(16, "little") for h in batch.stored],
            removed=[h.to_bytes(16, "little") for h in batch.removed],
            block_size=16,
        )


async def serving(servicer: disaggregation_pb2_grpc.LoadServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()  # gRPC's default message limits, as instances run
    disaggregation_pb2_grpc.add_LoadServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def polled_pool(address: str, num_total_blocks: int) -> InstancePool:
    pool = InstancePool(stale_after_s=60.0, routing="kv")
    pool.add(address, "prefill")
    report = disaggregation_pb2.LoadReport(instance_id="p", role="prefill", num_total_blocks=num_total_blocks)
    pool.record_report(address, report, serving=True)
    return pool


def indexed(pool: InstancePool, address: str) -> set[BlockHash]:
    blocks = pool.index._instances.get(address)
    return set(blocks.cached) if blocks is not None else set()


def test_a_snapshot_over_grpcs_message_limit_reaches_the_index_in_pages() -> None:
    log, hashes = filled_log(NUM_HASHES)
    assert len(hashes) * 18 > GRPC_DEFAULT_MAX_MESSAGE  # one message would be refused
    late, gone = BlockHash(7), [hashes[0], hashes[-1]]  # the first page's, and the last page's

    def change_while_paging() -> None:
        log.stored(late)
        for block_hash in gone:
            log.removed(block_hash)

    async def scenario() -> None:
        servicer = RecordingServicer(log, after_first=change_while_paging)
        server, address = await serving(servicer)
        pool = polled_pool(address, num_total_blocks=2 * NUM_HASHES)
        try:
            sync = KVEventsSync(pool, pool.index, interval_s=0.1)
            await sync.poll_once()
            assert len(servicer.sizes) == -(-NUM_HASHES // DEFAULT_PAGE_HASHES) > 1
            assert max(servicer.sizes) < GRPC_DEFAULT_MAX_MESSAGE
            assert indexed(pool, address) == set(hashes)  # the snapshot's moment, whole
            assert pool.index.cursor(address)[1] == NUM_HASHES  # its last_seq, before the changes
            await sync.poll_once()  # the changes made while it was paged
            assert indexed(pool, address) == (set(hashes) - set(gone)) | {late}
            assert pool.index.cursor(address) == (log.epoch, NUM_HASHES + 3)
        finally:
            await pool.close()
            await server.stop(grace=None)

    asyncio.run(scenario())


def test_a_refused_kv_events_call_is_logged_as_an_error_once(caplog: pytest.LogCaptureFixture) -> None:
    log, hashes = filled_log(NUM_HASHES)

    async def scenario() -> None:
        servicer = OneMessageServicer(log)
        server, address = await serving(servicer)
        pool = polled_pool(address, num_total_blocks=2 * NUM_HASHES)
        try:
            sync = KVEventsSync(pool, pool.index, interval_s=0.1)
            with caplog.at_level(logging.INFO, logger="gateway.kv_events"):
                await sync.poll_once()
                await sync.poll_once()
                errors = [r for r in caplog.records if r.levelno == logging.ERROR]
                assert len(errors) == 1, errors
                assert address in errors[0].getMessage() and "RESOURCE_EXHAUSTED" in errors[0].getMessage()
                assert indexed(pool, address) == set()
                # The instance is replaced by one that pages: its events are read again, and said so.
                servicer.upgraded = RecordingServicer(log)
                await sync.poll_once()
                assert indexed(pool, address) == set(hashes)
                assert any("read again" in r.getMessage() for r in caplog.records)
        finally:
            await pool.close()
            await server.stop(grace=None)

    asyncio.run(scenario())
