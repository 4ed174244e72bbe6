"""Someone else's UCX listener, posing as a prefill instance: a KV cache of the geometry a
fingerprint names, filled with a constant, published for one request with no pull token
(any pull gets it). Prints its address, then answers ``pulls`` on stdin with how many pull
requests reached it, until stdin closes. Run as ``python -m tests.services.rogue_prefill
FINGERPRINT_JSON REQUEST_ID NUM_BLOCKS``."""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from kv_connector.fingerprint import Fingerprint
from kv_connector.ucx import UCXConnector
from kv_connector.wire import PullReply, PullRequest

NUM_CACHE_BLOCKS = 16
POISON = 3.0  # every value of the served KV


class CountingConnector(UCXConnector):
    num_pull_requests = 0

    def _answer(self, data: bytes) -> tuple[PullReply, PullRequest | None]:
        self.num_pull_requests += 1
        return super()._answer(data)


async def main(fingerprint: Fingerprint, request_id: str, num_blocks: int) -> None:
    shape = (
        NUM_CACHE_BLOCKS,
        fingerprint.num_layers,
        2,
        fingerprint.block_size,
        fingerprint.num_kv_heads,
        fingerprint.head_dim,
    )
    cache = torch.full(shape, POISON, dtype=getattr(torch, fingerprint.dtype))
    connector = CountingConnector(cache, fingerprint)
    print(await connector.start("127.0.0.1", 0), flush=True)
    await connector.publish(request_id, list(range(num_blocks)), token_ids=[])
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() != "pulls":
            raise ValueError(f"unknown command {line!r}")
        print(connector.num_pull_requests, flush=True)
    await connector.close()


if __name__ == "__main__":
    asyncio.run(main(Fingerprint(**json.loads(sys.argv[1])), sys.argv[2], int(sys.argv[3])))
