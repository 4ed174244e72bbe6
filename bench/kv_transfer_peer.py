"""The prefill side of ``bench.kv_transfer``, in its own process.

It holds a KV cache filled with seeded random bytes, publishes one request per
prompt length on a :class:`UCXConnector` (at scattered, shuffled block ids), and
serves a raw UCX mode beside it: a contiguous buffer of the same bytes sent with
plain ucxx tag send/recv. It prints one JSON line (:class:`PeerReady`) and serves
until stdin closes. Started by the bench as
``python -m bench.kv_transfer_peer --spec '<PeerSpec JSON>'``.

The raw mode connects by worker address (exchanged over the bench's pipes), so it
opens no listening socket of its own; its messages use fixed tags. The bench
sends a command ``uint64[3] = (op, a, b)`` with :data:`TAG_COMMAND`:

- ``OP_SEND, nbytes``: the peer sends ``payload[:nbytes]`` with :data:`TAG_DATA`;
- ``OP_PING, request_bytes, reply_bytes``: the bench then sends ``request_bytes``
  bytes; the peer answers with an 8-byte size and ``reply_bytes`` bytes, the same
  four messages as the connector's ``send_obj`` / ``recv_obj`` header exchange;
- ``OP_BYE``: the bench is done with this connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kv_connector.fingerprint import Fingerprint
from kv_connector.ucx import UCXConnector

logger = logging.getLogger(__name__)

TAG_HELLO = 0x6B76_6265_6E63_0001  # bench -> peer: its worker address (8-byte size, then the bytes)
TAG_COMMAND = 0x6B76_6265_6E63_0002  # bench -> peer: uint64[3] commands, and ping request bodies
TAG_DATA = 0x6B76_6265_6E63_0003  # peer -> bench: payloads and ping replies
OP_BYE, OP_SEND, OP_PING = 0, 1, 2

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """What the bench asks its peer to hold and publish."""

    model_id: str  # the fingerprint's model identity
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_cache_blocks: int
    request_num_blocks: tuple[int, ...]  # one published request per entry
    seed: int

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(
            model=self.model_id, dtype=self.dtype, block_size=self.block_size,
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        )

    @property
    def cache_shape(self) -> tuple[int, int, int, int, int, int]:
        # [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
        return (self.num_layers, 2, self.num_cache_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * _DTYPES[self.dtype].itemsize

    @property
    def raw_bytes(self) -> int:
        """Size of the raw mode's payload: the largest request's KV."""
        return max(self.request_num_blocks) * self.bytes_per_block

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerSpec:
        body = json.loads(text)
        body["request_num_blocks"] = tuple(body["request_num_blocks"])
        return cls(**body)


@dataclass(frozen=True, slots=True)
class PeerReady:
    """The peer's one line on stdout once it serves."""

    connector_address: str  # host:port of the UCXConnector listener
    worker_address: str  # hex of the peer's UCX worker address, for the raw mode

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerReady:
        return cls(**json.loads(text))


def request_id(num_blocks: int) -> str:
    return f"bench-{num_blocks}-blocks"


def scattered_block_ids(side: str, seed: int, num_cache_blocks: int, num_blocks: int) -> list[int]:
    """``num_blocks`` distinct block ids drawn from the whole cache, in shuffled order, the
    same in both processes for the same arguments (``side`` keeps P's and D's apart)."""
    return random.Random(f"{side}-{seed}-{num_blocks}").sample(range(num_cache_blocks), num_blocks)


def seeded_cache(spec: PeerSpec) -> torch.Tensor:
    """P's KV cache: random bytes (any bit pattern, NaNs included; compare as bytes)."""
    cache = torch.empty(spec.cache_shape, dtype=_DTYPES[spec.dtype])
    cache.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(spec.seed))
    return cache


def seeded_payload(spec: PeerSpec) -> torch.Tensor:
    """The raw mode's contiguous payload, uint8 [raw_bytes]."""
    return torch.randint(0, 256, (spec.raw_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(spec.seed + 1))


async def _recv_bytes(nbytes: int, tag: int) -> np.ndarray:
    import ucxx

    buffer = np.empty(nbytes, dtype=np.uint8)
    await ucxx.recv(buffer, tag=tag)
    return buffer


async def serve_raw(payload: np.ndarray) -> None:
    """Serve raw-mode clients one after another, forever (cancelled at shutdown)."""
    import ucxx

    while True:
        (address_size,) = (await _recv_bytes(8, TAG_HELLO)).view(np.uint64)
        address = await _recv_bytes(int(address_size), TAG_HELLO)
        endpoint = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(address.tobytes()))
        command = np.empty(3, dtype=np.uint64)
        try:
            while True:
                await ucxx.recv(command, tag=TAG_COMMAND)
                op, a, b = (int(x) for x in command)
                if op == OP_BYE:
                    break
                if op == OP_SEND:
                    if a > payload.nbytes:
                        raise ValueError(f"asked for {a} raw bytes, the payload holds {payload.nbytes} (bug in the bench)")
                    await endpoint.send(payload[:a], tag=TAG_DATA, force_tag=True)
                elif op == OP_PING:
                    await _recv_bytes(a, TAG_COMMAND)
                    await endpoint.send(np.array([b], dtype=np.uint64), tag=TAG_DATA, force_tag=True)
                    await endpoint.send(np.zeros(b, dtype=np.uint8), tag=TAG_DATA, force_tag=True)
                else:
                    raise ValueError(f"unknown raw-mode op {op} (bug in the bench)")
        finally:
            await endpoint.close()


async def serve(spec: PeerSpec, host: str) -> None:
    import ucxx

    cache = seeded_cache(spec)
    payload = seeded_payload(spec).numpy()
    connector = UCXConnector(cache, spec.fingerprint)
    address = await connector.start(host, 0)
    for num_blocks in spec.request_num_blocks:
        block_ids = scattered_block_ids("prefill", spec.seed, spec.num_cache_blocks, num_blocks)
        connector.publish(request_id(num_blocks), block_ids, token_ids=[])  # the UCX connector ignores token_ids
    raw_task = asyncio.create_task(serve_raw(payload))
    worker_address = ucxx.get_worker_address()
    sys.stdout.write(PeerReady(address, worker_address.tobytes().hex()).to_json() + "\n")
    sys.stdout.flush()
    try:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes stdin
    finally:
        raw_task.cancel()
        await connector.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="peer %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="PeerSpec as JSON")
    parser.add_argument("--host", default="127.0.0.1", help="address to advertise")
    args = parser.parse_args(argv)
    asyncio.run(serve(PeerSpec.from_json(args.spec), args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
