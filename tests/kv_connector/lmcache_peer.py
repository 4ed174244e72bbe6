"""A prefill-side LMCache connector in its own process, for tests: fills a KV cache with
seeded random data, publishes PROMPT from PUBLISHED_BLOCKS into the store at ``--url``,
prints "published", and waits until stdin closes. Run as
``python -m tests.kv_connector.lmcache_peer --url redis://127.0.0.1:PORT``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch

from kv_connector.fingerprint import Fingerprint

SHAPE = (12, 2, 2, 16, 2, 8)  # blocks, layers, K/V, block_size, kv_heads, head_dim (block-major)
CHUNK_SIZE = 32  # two blocks per LMCache chunk, so chunk and block edges differ
PROMPT = [1000 + 7 * i for i in range(60)]  # 3 full blocks and 12 tokens of a fourth
PUBLISHED_BLOCKS = [5, 2, 9, 7]


def fingerprint(model: str = "tiny-0123") -> Fingerprint:
    return Fingerprint(
        model=model,
        dtype="bfloat16",
        block_size=SHAPE[3],
        num_layers=SHAPE[1],
        num_kv_heads=SHAPE[4],
        head_dim=SHAPE[5],
    )


def seeded_cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


async def serve(url: str, seed: int, model: str) -> None:
    from kv_connector.lmcache_connector import LMCacheConnector

    connector = LMCacheConnector(seeded_cache(seed), fingerprint(model), remote_url=url, chunk_size=CHUNK_SIZE)
    await connector.start("127.0.0.1", 0)
    published = await connector.publish("r", PUBLISHED_BLOCKS, PROMPT)
    print("published " + ",".join(digest.hex() for digest in published.chunk_digests), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    await connector.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny-0123")
    args = parser.parse_args()
    asyncio.run(serve(args.url, args.seed, args.model))
