"""UCX transfers between two real processes on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from kv_connector.base import KVSource, KVTransferError, gather_blocks  # noqa: E402
from kv_connector.block_copy import BlockCopier  # noqa: E402
from kv_connector.staging import StagingPool  # noqa: E402
from kv_connector.ucx import UCXConnector  # noqa: E402
from kv_connector.ucx_messages import ChunkPlan  # noqa: E402
from kv_connector.ucx_context import ucxx_for_running_loop  # noqa: E402
from tests.kv_connector.ucx_peer import PUBLISHED_BLOCKS, SHAPE, SLOW_BLOCKS, PeerState, fingerprint, seeded_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
BLOCKS_PER_CHUNK = 1  # four chunks per four-block pull: more chunks than staging buffers (3)


@dataclass(slots=True)
class Peer:
    address: str
    process: subprocess.Popen

    def stop(self) -> PeerState:
        """Close stdin, wait for the peer to exit and return the state it reports."""
        self.process.stdin.close()
        line = self.process.stdout.readline()
        self.process.wait(timeout=30)
        return PeerState(**json.loads(line))


@contextmanager
def running_peer(*args: str, seed: int = 7) -> Iterator[Peer]:
    """A prefill-side connector process (``tests.kv_connector.ucx_peer``), stopped afterwards."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.kv_connector.ucx_peer", "--seed", str(seed), "--blocks-per-chunk", str(BLOCKS_PER_CHUNK), *args],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **UCX_ENV},
    )
    peer = Peer("", process)
    try:
        peer.address = process.stdout.readline().strip()
        assert peer.address.startswith("127.0.0.1:"), peer.address
        yield peer
    finally:
        if not process.stdin.closed:
            process.stdin.close()
        process.wait(timeout=30)
        process.stdout.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    with running_peer() as running:
        yield running.address


# ------------------------------------------------------------- in-process parts


@pytest.mark.parametrize("contiguous", [True, False], ids=["numpy-runs", "torch-fallback"])
def test_block_copier_round_trips_scattered_blocks(contiguous: bool) -> None:
    remote = seeded_cache(3)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    if not contiguous:  # same layout and values, strided storage: the torch path
        remote = torch.empty(SHAPE[::-1], dtype=torch.bfloat16).permute(5, 4, 3, 2, 1, 0).copy_(remote)
        local = torch.empty(SHAPE[::-1], dtype=torch.bfloat16).permute(5, 4, 3, 2, 1, 0).zero_()
    remote_copier, local_copier = BlockCopier(remote), BlockCopier(local)
    chunk = torch.zeros(3 * remote_copier.bytes_per_block + 5, dtype=torch.uint8)  # a staging slot larger than needed
    remote_copier.gather([9, 2, 11], chunk)
    assert torch.equal(remote_copier.chunk_view(chunk, 3), gather_blocks(remote, [9, 2, 11]))
    local_copier.scatter([4, 0, 7], chunk)
    for mine, theirs in zip([4, 0, 7], [9, 2, 11], strict=True):
        assert torch.equal(local[:, :, mine], remote[:, :, theirs])
    assert not local[:, :, [1, 2, 3, 5, 6, 8, 9, 10, 11]].any()


def test_block_copier_refuses_ids_outside_the_cache() -> None:
    copier = BlockCopier(torch.zeros(SHAPE, dtype=torch.bfloat16))
    copier.check_block_ids([0, 11])
    with pytest.raises(RuntimeError, match="outside a cache of 12 blocks"):
        copier.check_block_ids([3, 12])


def test_staging_pool_reuses_buffers_up_to_its_cap() -> None:
    pool = StagingPool(slot_bytes=64, device=torch.device("cpu"), max_idle=2)
    pool.reserve(3)
    assert pool.num_idle == 2
    first = pool.acquire(3)
    assert pool.num_idle == 0 and [slot.numel() for slot in first] == [64, 64, 64]
    pool.release(first)
    assert pool.num_idle == 2
    again = pool.acquire(2)
    assert {slot.data_ptr() for slot in again} <= {slot.data_ptr() for slot in first}


def test_chunk_plan_cuts_blocks_in_order() -> None:
    plan = ChunkPlan(num_blocks=10, blocks_per_chunk=4)
    assert plan.num_chunks == 3
    assert [plan.bounds(chunk) for chunk in range(3)] == [(0, 4), (4, 8), (8, 10)]


# ------------------------------------------------------------- two processes


def source(address: str, request_id: str = "r", blocks: list[int] = PUBLISHED_BLOCKS, model: str = "tiny-0123") -> KVSource:
    return KVSource(request_id=request_id, address=address, block_ids=tuple(blocks), num_tokens=60, fingerprint=fingerprint(model))


def decode_connector(cache: torch.Tensor, model: str = "tiny-0123", blocks_per_chunk: int = BLOCKS_PER_CHUNK) -> UCXConnector:
    return UCXConnector(cache, fingerprint(model), blocks_per_chunk=blocks_per_chunk)


def run(scenario) -> object:  # noqa: ANN001 - an async function taking no arguments
    os.environ.update(UCX_ENV)
    return asyncio.run(scenario())


def pull(cache: torch.Tensor, src: KVSource, local_blocks: list[int], first_block: int = 0, model: str = "tiny-0123"):
    async def scenario():
        connector = decode_connector(cache, model)
        try:
            return await connector.pull(src, local_blocks, first_block, timeout_s=10.0)
        finally:
            await connector.close()

    return run(scenario)


def test_pull_copies_exactly_the_named_blocks(peer: str) -> None:
    remote = seeded_cache(7)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    stats = pull(local, source(peer), [0, 3, 11, 6])
    assert stats.num_blocks == 4 and stats.num_bytes == 4 * remote[:, :, 0].numel() * 2
    for mine, theirs in zip([0, 3, 11, 6], PUBLISHED_BLOCKS, strict=True):
        assert torch.equal(local[:, :, mine], remote[:, :, theirs])
    untouched = [b for b in range(SHAPE[2]) if b not in (0, 3, 11, 6)]
    assert not local[:, :, untouched].any()


def test_local_prefix_hits_are_not_pulled(peer: str) -> None:
    remote = seeded_cache(7)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    stats = pull(local, source(peer), [1, 2, 3, 4], first_block=2)
    assert stats.num_blocks == 2
    assert not local[:, :, [1, 2]].any()
    assert torch.equal(local[:, :, 3], remote[:, :, PUBLISHED_BLOCKS[2]])
    assert torch.equal(local[:, :, 4], remote[:, :, PUBLISHED_BLOCKS[3]])


def test_pulls_reuse_one_connection_and_refusals_drop_it(peer: str) -> None:
    remote = seeded_cache(7)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)

    async def scenario() -> None:
        connector = decode_connector(local)
        try:
            for local_blocks in ([0, 1, 2, 3], [8, 6, 4, 10]):
                await connector.pull(source(peer), local_blocks, 0, timeout_s=10.0)
                assert connector.num_idle_connections == 1
                assert torch.equal(local[:, :, local_blocks], remote[:, :, PUBLISHED_BLOCKS])
            with pytest.raises(KVTransferError, match="no KV published"):
                await connector.pull(source(peer, request_id="other"), [0, 1, 2, 3], 0, timeout_s=10.0)
            assert connector.num_idle_connections == 0  # it had receives posted for chunks that never come
            local.zero_()
            await connector.pull(source(peer), [0, 1, 2, 3], 0, timeout_s=10.0)
            assert torch.equal(local[:, :, [0, 1, 2, 3]], remote[:, :, PUBLISHED_BLOCKS])
            assert connector.num_transfers_in_flight == 0
        finally:
            await connector.close()

    run(scenario)


def test_chunk_size_mismatch_is_refused(peer: str) -> None:
    async def scenario() -> None:
        connector = decode_connector(torch.zeros(SHAPE, dtype=torch.bfloat16), blocks_per_chunk=2)
        try:
            await connector.pull(source(peer), [0, 1, 2, 3], 0, timeout_s=10.0)
        finally:
            await connector.close()

    with pytest.raises(KVTransferError, match="blocks_per_chunk must be the same"):
        run(scenario)


def test_unknown_request_is_refused(peer: str) -> None:
    with pytest.raises(KVTransferError, match="no KV published for request 'other'"):
        pull(torch.zeros(SHAPE, dtype=torch.bfloat16), source(peer, request_id="other"), [0, 1, 2, 3])


def test_blocks_outside_the_request_are_refused(peer: str) -> None:
    with pytest.raises(KVTransferError, match=r"blocks \[0\] are not the request's"):
        pull(torch.zeros(SHAPE, dtype=torch.bfloat16), source(peer, blocks=[5, 0]), [1, 2])


def test_fingerprint_mismatch_is_refused_on_both_sides(peer: str) -> None:
    # Caught locally against the handle's fingerprint...
    with pytest.raises(KVTransferError, match="model: decode has 'tiny-9999', prefill has 'tiny-0123'"):
        pull(torch.zeros(SHAPE, dtype=torch.bfloat16), source(peer), [0, 1, 2, 3], model="tiny-9999")
    # ...and by the peer, when the handle claims what the peer is not.
    with pytest.raises(KVTransferError, match="refused the pull: KV caches are incompatible"):
        pull(torch.zeros(SHAPE, dtype=torch.bfloat16), source(peer, model="tiny-9999"), [0, 1, 2, 3], model="tiny-9999")


def test_oversized_header_closes_only_that_connection(peer: str) -> None:
    async def scenario() -> None:
        ucxx = ucxx_for_running_loop()
        host, _, port = peer.rpartition(":")
        endpoint = await ucxx.create_endpoint(host, int(port))
        try:
            await endpoint.send(np.array([1 << 40], dtype=np.uint64))  # a header size the peer must not allocate
            with pytest.raises(Exception):  # noqa: B017, PT011 - the peer closes the connection; ucxx names it variously
                await asyncio.wait_for(endpoint.recv(np.empty(8, dtype=np.uint8)), 10.0)
        finally:
            await endpoint.close()

    run(scenario)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    pull(local, source(peer), [0, 1, 2, 3])
    assert torch.equal(local[:, :, [0, 1, 2, 3]], seeded_cache(7)[:, :, PUBLISHED_BLOCKS])


def test_pull_cancelled_mid_transfer_leaves_nothing_behind() -> None:
    """P stalls after the first chunk of "slow" is on the wire; D's pull times out. D's blocks
    are not written after the pull raised, its connection is dropped, both sides end with no
    transfer in flight, and the same request then pulls intact on the same connectors.
    A pull of "r" first opens the connection (its four chunks are gathers 1-4), so that the
    short timeout covers only the transfer; gather 6 is the second chunk of "slow"."""
    stall_s = 2.0
    remote = seeded_cache(7)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    local_blocks = [6, 0, 8, 4]
    with running_peer("--stall-at-gather", "6", "--stall-seconds", str(stall_s), "--drain-seconds", "5") as running:

        async def scenario() -> None:
            connector = decode_connector(local)
            try:
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                local.zero_()
                started = time.monotonic()
                with pytest.raises(KVTransferError, match="timed out after 0.5 s"):
                    await connector.pull(source(running.address, "slow", SLOW_BLOCKS), local_blocks, 0, timeout_s=0.5)
                # Mid-pull: the first chunk landed, the others did not.
                assert torch.equal(local[:, :, local_blocks[0]], remote[:, :, SLOW_BLOCKS[0]])
                assert not local[:, :, local_blocks[1:]].any()
                assert connector.num_transfers_in_flight == 0 and connector.num_idle_connections == 0
                # Nothing writes into the blocks once the pull has raised, even after P wakes up and sends on.
                local.zero_()
                await asyncio.sleep(stall_s - (time.monotonic() - started) + 0.5)
                assert not local.any()
                await connector.pull(source(running.address, "slow", SLOW_BLOCKS), local_blocks, 0, timeout_s=10.0)
                assert torch.equal(local[:, :, local_blocks], remote[:, :, SLOW_BLOCKS])
            finally:
                await connector.close()

        run(scenario)
        assert running.stop() == PeerState(transfers_in_flight=0, serving_connections=0)


def test_idle_connection_the_peer_dropped_is_replaced() -> None:
    remote = seeded_cache(7)
    local = torch.zeros(SHAPE, dtype=torch.bfloat16)
    with running_peer() as running:

        async def scenario() -> None:
            connector = decode_connector(local)
            try:
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                assert connector.num_idle_connections == 1
                running.process.stdin.write("drop\n")
                running.process.stdin.flush()
                assert running.process.stdout.readline().strip() == "dropped"
                local.zero_()
                await connector.pull(source(running.address), [0, 1, 2, 3], 0, timeout_s=10.0)
                assert torch.equal(local[:, :, [0, 1, 2, 3]], remote[:, :, PUBLISHED_BLOCKS])
                assert connector.num_idle_connections == 1
            finally:
                await connector.close()

        run(scenario)


def test_unreachable_peer_fails_fast_without_hanging() -> None:
    with pytest.raises(KVTransferError, match="127.0.0.1:9"):
        pull(torch.zeros(SHAPE, dtype=torch.bfloat16), source("127.0.0.1:9"), [0, 1, 2, 3])
