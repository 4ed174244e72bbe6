"""The prefill side of ``microbench.kv_transfer``, in its own process.

It holds a block-major KV cache (engine/kv_cache_layout.py) filled with seeded
random bytes and publishes two requests per prompt length on a :class:`UCXConnector`:
one at scattered, shuffled block ids (the connector then sends one message per block),
one at consecutive ids from 0, as a freshly started engine allocates them (messages of
up to ``MAX_MESSAGE_BYTES``). Beside it the peer serves a raw mode: a contiguous payload
of the same bytes sent with plain ucxx endpoint send/recv, on a second ucxx listener,
so that both paths use the same kind of endpoint (a client-server one, over the same
UCX transports) and the same ucxx runtime (:mod:`kv_connector.ucx_context`). It prints
one JSON line (:class:`PeerReady`) and serves until stdin closes. Started by the bench
as ``python -m microbench.kv_transfer_peer --spec '<PeerSpec JSON>'``.

Raw mode: the bench keeps one endpoint open and sends commands with ``send_obj``
(:func:`raw_command`), as the connector sends its pull request:

- ``OP_SEND, nbytes``: the peer sends ``payload[:nbytes]`` as one message;
- ``OP_MESSAGES, nbytes, message_bytes``: the peer sends ``payload[:nbytes]`` as messages
  of ``message_bytes`` (the last one shorter), tagged by index, at most ``WINDOW`` in
  flight: the connector's wire pattern with no connector logic;
- ``OP_PING, reply_bytes`` (the command padded to the pull request's size): the peer
  answers with ``send_obj`` of ``reply_bytes`` bytes, the connector's header exchange
  without the connector;
- ``OP_CPU``: the peer answers with its process CPU seconds so far (JSON), to split
  a transfer's CPU time between the two processes.

An idle raw endpoint costs the peer nothing: with the connector's ucxx runtime a posted
receive waits on an asyncio future instead of spinning the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import struct
import sys
from collections import deque
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

from engine.kv_cache_layout import allocate_kv_cache
from kv_connector.fingerprint import Fingerprint
from kv_connector.ucx import WINDOW, UCXConnector
from kv_connector.ucx_context import ucxx_for_running_loop

logger = logging.getLogger(__name__)

OP_SEND, OP_PING, OP_MESSAGES, OP_CPU = 1, 2, 3, 4
_COMMAND = struct.Struct("<QQQ")  # op, argument, second argument

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Where a request's blocks sit in both caches: the connector's worst case (no two blocks
# consecutive on both sides, so one message each) and its best (one run of ids, so
# messages as long as MAX_MESSAGE_BYTES allows).
BlockLayout = Literal["scattered", "consecutive"]
BLOCK_LAYOUTS: tuple[BlockLayout, ...] = ("scattered", "consecutive")


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
            model=self.model_id,
            dtype=self.dtype,
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

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
    raw_address: str  # host:port of the raw mode's listener

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerReady:
        return cls(**json.loads(text))


def request_id(num_blocks: int, layout: BlockLayout) -> str:
    return f"bench-{num_blocks}-{layout}-blocks"


def request_block_ids(
    side: Literal["prefill", "decode"], layout: BlockLayout, spec: PeerSpec, num_blocks: int
) -> list[int]:
    """A request's block ids on one side, the same in both processes for the same arguments."""
    if layout == "consecutive":
        return list(range(num_blocks))
    return scattered_block_ids(side, spec.seed, spec.num_cache_blocks, num_blocks)


def scattered_block_ids(side: str, seed: int, num_cache_blocks: int, num_blocks: int) -> list[int]:
    """``num_blocks`` distinct block ids drawn from the whole cache, in shuffled order, no
    id followed by its successor (so no two blocks share a message, whatever the other
    side's ids); ``side`` keeps P's and D's apart."""
    draw = random.Random(f"{side}-{seed}-{num_blocks}")
    while True:  # a draw holds about num_blocks / num_cache_blocks such pairs on average: a few draws at most
        block_ids = draw.sample(range(num_cache_blocks), num_blocks)
        if all(b != a + 1 for a, b in zip(block_ids, block_ids[1:])):
            return block_ids


def empty_cache(spec: PeerSpec) -> torch.Tensor:
    """A zeroed host KV cache of the spec's shape, in the engine's block-major layout."""
    return allocate_kv_cache(
        spec.num_cache_blocks,
        spec.num_layers,
        spec.block_size,
        spec.num_kv_heads,
        spec.head_dim,
        spec.torch_dtype,
        torch.device("cpu"),
    )


def seeded_cache(spec: PeerSpec) -> torch.Tensor:
    """P's KV cache: random bytes (any bit pattern, NaNs included; compare as bytes)."""
    cache = empty_cache(spec)
    cache.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(spec.seed))
    return cache


def seeded_payload(spec: PeerSpec) -> torch.Tensor:
    """The raw mode's contiguous payload, uint8 [raw_bytes]."""
    return torch.randint(
        0, 256, (spec.raw_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(spec.seed + 1)
    )


def raw_command(op: int, argument: int = 0, second: int = 0, size: int = _COMMAND.size) -> bytes:
    """A raw-mode command, zero-padded to ``size`` bytes (a ping mimics the pull request's size)."""
    return _COMMAND.pack(op, argument, second).ljust(size, b"\0")


def message_slices(num_bytes: int, message_bytes: int) -> list[slice]:
    """The raw mode's messages: ``message_bytes`` each, the last one shorter."""
    return [slice(start, min(start + message_bytes, num_bytes)) for start in range(0, num_bytes, message_bytes)]


def process_cpu_s() -> float:
    """CPU seconds this process has used, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class RawServer:
    """The raw mode: commands on any number of client endpoints, one at a time each."""

    def __init__(self, payload: np.ndarray) -> None:
        self._payload = payload
        self._listener = None
        self._endpoints: set[object] = set()

    def start(self, host: str) -> str:
        ucxx = ucxx_for_running_loop()  # the connector's ucxx settings (see kv_connector.ucx_context)
        self._listener = ucxx.create_listener(self._serve, port=None)
        return f"{host}:{self._listener.port}"

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for endpoint in list(self._endpoints):
            await endpoint.close()

    async def _serve(self, endpoint) -> None:
        self._endpoints.add(endpoint)
        try:
            while True:
                try:
                    command = bytes(await endpoint.recv_obj())
                except Exception:
                    return
                await self._run(endpoint, *_COMMAND.unpack_from(command))
        except Exception:  # the bench sees the failure as a timeout; the reason goes to stderr
            logger.exception("serving the raw mode failed")
        finally:
            self._endpoints.discard(endpoint)
            await endpoint.close()

    async def _run(self, endpoint, op: int, argument: int, second: int) -> None:
        if op in (OP_SEND, OP_MESSAGES) and argument > self._payload.nbytes:
            raise ValueError(
                f"asked for {argument} raw bytes, the payload holds {self._payload.nbytes} (bug in the bench)"
            )
        if op == OP_SEND:
            await endpoint.send(self._payload[:argument])
        elif op == OP_MESSAGES:
            await self._send_messages(endpoint, argument, second)
        elif op == OP_PING:
            await endpoint.send_obj(bytes(argument))
        elif op == OP_CPU:
            await endpoint.send_obj(json.dumps(process_cpu_s()).encode())
        else:
            raise ValueError(f"unknown raw-mode op {op} (bug in the bench)")

    async def _send_messages(self, endpoint, num_bytes: int, message_bytes: int) -> None:
        """As the connector sends a pull: tagged messages, at most ``WINDOW`` in flight."""
        if message_bytes < 1:
            raise ValueError(f"asked for raw messages of {message_bytes} bytes (bug in the bench)")
        sends: deque[asyncio.Future] = deque()
        for index, span in enumerate(message_slices(num_bytes, message_bytes)):
            if len(sends) >= WINDOW:
                await sends.popleft()
            sends.append(asyncio.ensure_future(endpoint.send(self._payload[span], tag=index)))
        await asyncio.gather(*sends)


async def serve(spec: PeerSpec, host: str) -> None:
    cache = seeded_cache(spec)
    connector = UCXConnector(cache, spec.fingerprint)
    raw = RawServer(seeded_payload(spec).numpy())
    try:
        connector_address = await connector.start(host, 0)
        for num_blocks in spec.request_num_blocks:
            for layout in BLOCK_LAYOUTS:
                block_ids = request_block_ids("prefill", layout, spec, num_blocks)
                await connector.publish(
                    request_id(num_blocks, layout), block_ids, token_ids=[]
                )  # the UCX connector ignores token_ids
        sys.stdout.write(PeerReady(connector_address, raw.start(host)).to_json() + "\n")
        sys.stdout.flush()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes stdin
    finally:
        await raw.stop()
        await connector.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="peer %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m microbench.kv_transfer_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="PeerSpec as JSON")
    parser.add_argument("--host", default="127.0.0.1", help="address to advertise")
    args = parser.parse_args(argv)
    asyncio.run(serve(PeerSpec.from_json(args.spec), args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
