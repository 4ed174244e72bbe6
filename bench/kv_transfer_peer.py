"""The prefill side of ``bench.kv_transfer``, in its own process.

It holds a KV cache filled with seeded random bytes, publishes one request per
prompt length on a :class:`UCXConnector` (at scattered, shuffled block ids), and
beside it serves a raw mode: a contiguous payload of the same bytes sent with plain
ucxx endpoint send/recv, on a second ucxx listener, so that both paths use the same
kind of endpoint (a client-server one, over the same UCX transports). It prints one
JSON line (:class:`PeerReady`) and serves until stdin closes. Started by the bench as
``python -m bench.kv_transfer_peer --spec '<PeerSpec JSON>'``.

Raw mode: the bench keeps one endpoint open and, in a *session*, sends commands with
``send_obj`` (:func:`raw_command`), as the connector sends its pull request:

- ``OP_SEND, nbytes``: the peer sends ``payload[:nbytes]``;
- ``OP_PING, reply_bytes`` (the command padded to the pull request's size): the peer
  answers with ``send_obj`` of ``reply_bytes`` bytes, the connector's header exchange
  without the connector;
- ``OP_PAUSE``: the session ends.

A session starts when the bench writes the line ``raw`` on the peer's stdin. Sessions
exist because ucxx (without ``UCXPY_ENABLE_PYTHON_FUTURE=1``) awaits a request by
spinning the event loop: a receive left posted while the bench times something else
would keep one of the peer's cores busy and skew every other figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import struct
import sys
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kv_connector.fingerprint import Fingerprint
from kv_connector.ucx import UCXConnector

logger = logging.getLogger(__name__)

OP_PAUSE, OP_SEND, OP_PING = 0, 1, 2
_COMMAND = struct.Struct("<QQ")  # op, argument

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
    raw_address: str  # host:port of the raw mode's listener

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


def raw_command(op: int, argument: int = 0, size: int = _COMMAND.size) -> bytes:
    """A raw-mode command, zero-padded to ``size`` bytes (a ping mimics the pull request's size)."""
    return _COMMAND.pack(op, argument).ljust(size, b"\0")


class RawServer:
    """The raw mode: one client endpoint at a time, served one session at a time."""

    def __init__(self, payload: np.ndarray) -> None:
        self._payload = payload
        self._sessions: asyncio.Queue[bool] = asyncio.Queue()  # True: serve a session; False: stop
        self._listener = None
        self._client_done: asyncio.Event | None = None  # set once a connected client's handler has finished

    def start(self, host: str) -> str:
        import ucxx

        self._listener = ucxx.create_listener(self._serve, port=None)
        return f"{host}:{self._listener.port}"

    def begin_session(self) -> None:
        self._sessions.put_nowait(True)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Let a connected client's handler close its endpoint, then stop listening."""
        self._sessions.put_nowait(False)
        if self._client_done is not None:
            try:
                await asyncio.wait_for(self._client_done.wait(), timeout_s)
            except TimeoutError:
                logger.warning("the raw-mode handler did not finish within %.0f s", timeout_s)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve(self, endpoint) -> None:  # noqa: ANN001 - ucxx endpoint
        self._client_done = asyncio.Event()
        try:
            while await self._sessions.get():
                await self._serve_session(endpoint)
        except Exception:  # the bench sees the failure as a timeout; the reason goes to stderr
            logger.exception("serving the raw mode failed")
        finally:
            await endpoint.close()
            self._client_done.set()

    async def _serve_session(self, endpoint) -> None:  # noqa: ANN001 - ucxx endpoint
        while True:
            command = bytes(await endpoint.recv_obj())
            op, argument = _COMMAND.unpack_from(command)
            if op == OP_PAUSE:
                return
            if op == OP_SEND:
                if argument > self._payload.nbytes:
                    raise ValueError(f"asked for {argument} raw bytes, the payload holds {self._payload.nbytes} (bug in the bench)")
                await endpoint.send(self._payload[:argument])
            elif op == OP_PING:
                await endpoint.send_obj(bytes(argument))
            else:
                raise ValueError(f"unknown raw-mode op {op} (bug in the bench)")


async def serve(spec: PeerSpec, host: str) -> None:
    cache = seeded_cache(spec)
    connector = UCXConnector(cache, spec.fingerprint)
    raw = RawServer(seeded_payload(spec).numpy())
    try:
        connector_address = await connector.start(host, 0)
        for num_blocks in spec.request_num_blocks:
            block_ids = scattered_block_ids("prefill", spec.seed, spec.num_cache_blocks, num_blocks)
            connector.publish(request_id(num_blocks), block_ids, token_ids=[])  # the UCX connector ignores token_ids
        sys.stdout.write(PeerReady(connector_address, raw.start(host)).to_json() + "\n")
        sys.stdout.flush()
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):  # "" once the bench closes stdin
            if line.strip() != "raw":
                raise ValueError(f"unknown control line {line!r} (bug in the bench)")
            raw.begin_session()
    finally:
        await raw.stop()
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
