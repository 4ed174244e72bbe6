"""UCX transfers between two real processes on loopback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("ucxx")

from kv_connector.base import KVSource, KVTransferError  # noqa: E402
from kv_connector.ucx import UCXConnector  # noqa: E402
from tests.kv_connector.ucx_peer import PUBLISHED_BLOCKS, SHAPE, fingerprint, seeded_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    """A prefill-side connector process; yields its address and stops it afterwards."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.kv_connector.ucx_peer", "--seed", "7"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **UCX_ENV},
    )
    try:
        address = process.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        process.stdin.close()
        process.wait(timeout=30)


def source(address: str, request_id: str = "r", blocks: list[int] = PUBLISHED_BLOCKS, model: str = "tiny-0123") -> KVSource:
    return KVSource(request_id=request_id, address=address, block_ids=tuple(blocks), num_tokens=60, fingerprint=fingerprint(model))


def pull(cache: torch.Tensor, src: KVSource, local_blocks: list[int], first_block: int = 0, model: str = "tiny-0123"):
    async def run():
        connector = UCXConnector(cache, fingerprint(model))
        try:
            return await connector.pull(src, local_blocks, first_block, timeout_s=10.0)
        finally:
            await connector.close()

    os.environ.update(UCX_ENV)
    return asyncio.run(run())


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


def test_unreachable_peer_fails_fast_without_hanging() -> None:
    with pytest.raises(KVTransferError, match="127.0.0.1:9"):
        pull(torch.zeros(SHAPE, dtype=torch.bfloat16), source("127.0.0.1:9"), [0, 1, 2, 3])
