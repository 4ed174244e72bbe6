"""A prefill-side UCX connector in its own process, for tests: fills a KV cache with
seeded random data, publishes blocks for requests "r" and "slow", prints its address,
and serves until stdin closes (a line ``drop`` makes it close every connection from a
decode side and answer ``dropped``); then it waits up to ``--drain-seconds`` for connections
to close and prints its connector's state as one JSON line (:class:`PeerState`). Run as ``python -m tests.kv_connector.ucx_peer``.

``--stall-at-gather K --stall-seconds S`` blocks the peer's event loop for S seconds in
the K-th chunk it gathers (counting from 1 over the peer's life): with one block per
chunk and K=2, a pull stops right after its first chunk is on the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from kv_connector.fingerprint import Fingerprint
from kv_connector.ucx import UCXConnector

SHAPE = (2, 2, 12, 16, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
PUBLISHED_BLOCKS = [5, 2, 9, 7]
SLOW_BLOCKS = [1, 10, 3, 11]  # request "slow", for stalls


@dataclass(frozen=True, slots=True)
class PeerState:
    transfers_in_flight: int
    serving_connections: int


def fingerprint(model: str = "tiny-0123") -> Fingerprint:
    return Fingerprint(model=model, dtype="bfloat16", block_size=SHAPE[3], num_layers=SHAPE[0], num_kv_heads=SHAPE[4], head_dim=SHAPE[5])


def seeded_cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


class StallingConnector(UCXConnector):
    """Blocks the event loop once, in the ``stall_at``-th chunk gather."""

    def __init__(self, *args, stall_at: int, stall_s: float, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._stall_at = stall_at
        self._stall_s = stall_s
        self._num_gathers = 0

    def _gather_chunk(self, block_ids: list[int], slot: torch.Tensor) -> None:
        self._num_gathers += 1
        if self._num_gathers == self._stall_at:
            time.sleep(self._stall_s)
        super()._gather_chunk(block_ids, slot)

    async def drop_connections(self) -> None:
        """Close every decode-side connection, as a restarted prefill instance would have."""
        for endpoint in list(self._serving):
            await endpoint.close()


async def serve(args: argparse.Namespace) -> None:
    cache = seeded_cache(args.seed)
    connector = StallingConnector(
        cache, fingerprint(args.model), blocks_per_chunk=args.blocks_per_chunk, stall_at=args.stall_at_gather, stall_s=args.stall_seconds
    )
    address = await connector.start("127.0.0.1", args.port)
    connector.publish("r", PUBLISHED_BLOCKS, token_ids=list(range(60)))
    connector.publish("slow", SLOW_BLOCKS, token_ids=list(range(60)))
    print(address, flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):  # "" once the test closes stdin
        if line.strip() != "drop":
            raise ValueError(f"unknown command {line!r}")
        await connector.drop_connections()
        while connector.num_serving_connections:
            await asyncio.sleep(0.01)
        print("dropped", flush=True)
    deadline = time.monotonic() + args.drain_seconds  # connections the test closed end on their own, soon
    while connector.num_serving_connections and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    state = PeerState(connector.num_transfers_in_flight, connector.num_serving_connections)
    print(json.dumps(asdict(state)), flush=True)
    await connector.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny-0123")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--blocks-per-chunk", type=int, default=None)
    parser.add_argument("--stall-at-gather", type=int, default=0, help="0: never stall")
    parser.add_argument("--stall-seconds", type=float, default=0.0)
    parser.add_argument("--drain-seconds", type=float, default=0.0, help="wait up to this long for open connections to end before reporting")
    asyncio.run(serve(parser.parse_args()))
