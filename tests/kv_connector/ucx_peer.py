"""A prefill-side UCX connector in its own process, for tests: fills a KV cache with
seeded random data, publishes blocks for request "r", prints its address, and
serves until stdin closes. Run as ``python -m tests.kv_connector.ucx_peer``."""

from __future__ import annotations

import argparse
import asyncio
import sys

import torch

from kv_connector.fingerprint import Fingerprint
from kv_connector.ucx import UCXConnector

SHAPE = (2, 2, 12, 16, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
PUBLISHED_BLOCKS = [5, 2, 9, 7]


def fingerprint(model: str = "tiny-0123") -> Fingerprint:
    return Fingerprint(model=model, dtype="bfloat16", block_size=SHAPE[3], num_layers=SHAPE[0], num_kv_heads=SHAPE[4], head_dim=SHAPE[5])


def seeded_cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


async def serve(seed: int, model: str) -> None:
    connector = UCXConnector(seeded_cache(seed), fingerprint(model))
    address = await connector.start("127.0.0.1", 0)
    connector.publish("r", PUBLISHED_BLOCKS, token_ids=list(range(60)))
    print(address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    await connector.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny-0123")
    args = parser.parse_args()
    asyncio.run(serve(args.seed, args.model))
