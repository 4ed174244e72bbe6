"""The decode side of ``microbench.kv_transfer``'s peer: start the prefill-side process
(:mod:`microbench.kv_transfer_peer`), read its ready line, stop it; and :class:`RawClient`, this
side of the peer's raw UCX mode (the same bytes as a pull, with no connector logic)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kv_connector.ucx import WINDOW  # imports ucxx only when used, after the UCX environment is set
from kv_connector.ucx_context import ucxx_for_running_loop
from microbench.kv_transfer_peer import (
    OP_CPU,
    OP_MESSAGES,
    OP_PING,
    OP_SEND,
    PeerReady,
    PeerSpec,
    message_slices,
    raw_command,
)

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
_PEER_START_TIMEOUT_S = 120.0
_PEER_STOP_TIMEOUT_S = 30.0


class Peer:
    """The running prefill-side process and its addresses."""

    def __init__(self, process: subprocess.Popen, ready: PeerReady) -> None:
        self._process = process
        self.ready = ready


@contextmanager
def peer_process(spec: PeerSpec) -> Iterator[Peer]:
    """Start the prefill-side process, yield it once it serves, and always stop it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "microbench.kv_transfer_peer", "--spec", spec.to_json(), "--host", "127.0.0.1"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        readable, _, _ = select.select([process.stdout], [], [], _PEER_START_TIMEOUT_S)
        if not readable:
            raise RuntimeError(
                f"the peer process was not ready within {_PEER_START_TIMEOUT_S:.0f} s; see its stderr above"
            )
        line = process.stdout.readline()  # its one line; the peer writes nothing else to stdout
        if not line:
            raise RuntimeError(
                f"the peer process exited (code {process.wait(timeout=_PEER_STOP_TIMEOUT_S)}) before it was ready; "
                "see its stderr above"
            )
        try:
            ready = PeerReady.from_json(line)
        except (ValueError, TypeError):
            raise RuntimeError(f"the peer process wrote {line!r} instead of its ready line (bug)") from None
        yield Peer(process, ready)
    finally:
        try:
            process.stdin.close()
            process.wait(timeout=_PEER_STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            logger.warning(
                "peer %d did not stop within %.0f s of stdin closing; killing it", process.pid, _PEER_STOP_TIMEOUT_S
            )
            process.kill()
            process.wait()
        process.stdout.close()


class RawClient:
    """This side of the peer's raw mode: plain ucxx endpoint send/recv on one client-server
    endpoint kept open across transfers (protocol in :mod:`microbench.kv_transfer_peer`)."""

    def __init__(self, endpoint, timeout_s: float) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s  # per transfer, like the connector's pulls: a dead peer must not hang the bench

    @classmethod
    async def connect(cls, peer: Peer, timeout_s: float) -> RawClient:
        # The connector's ucxx runtime (asyncio futures, no spinning waits): both paths run on it.
        ucxx = ucxx_for_running_loop()
        host, _, port = peer.ready.raw_address.rpartition(":")
        return cls(await ucxx.create_endpoint(host, int(port)), timeout_s)

    async def fetch(self, buffer: np.ndarray) -> None:
        """Receive the first ``buffer.nbytes`` bytes of the peer's payload into ``buffer``:
        one ``send_obj`` request, one payload, as a pull minus its reply header."""

        async def exchange() -> None:
            await self._endpoint.send_obj(raw_command(OP_SEND, buffer.nbytes))
            await self._endpoint.recv(buffer)

        await asyncio.wait_for(exchange(), self._timeout_s)

    async def fetch_messages(self, buffer: np.ndarray, message_bytes: int) -> None:
        """Like :meth:`fetch`, the payload in tagged messages of ``message_bytes`` with at most
        ``WINDOW`` receives posted, as the connector receives a pull: its wire pattern with
        no connector logic."""

        async def exchange() -> None:
            await self._endpoint.send_obj(raw_command(OP_MESSAGES, buffer.nbytes, message_bytes))
            receives: deque[asyncio.Future] = deque()
            for index, span in enumerate(message_slices(buffer.nbytes, message_bytes)):
                if len(receives) >= WINDOW:
                    await receives.popleft()
                receives.append(asyncio.ensure_future(self._endpoint.recv(buffer[span], tag=index)))
            await asyncio.gather(*receives)

        await asyncio.wait_for(exchange(), self._timeout_s)

    async def ping(self, request_bytes: int, reply_bytes: int) -> None:
        """The connector's header exchange without the connector: ``send_obj`` of a
        ``request_bytes`` body, ``recv_obj`` of a ``reply_bytes`` one."""

        async def exchange() -> None:
            await self._endpoint.send_obj(raw_command(OP_PING, reply_bytes, size=request_bytes))
            await self._endpoint.recv_obj()

        await asyncio.wait_for(exchange(), self._timeout_s)

    async def peer_cpu_s(self) -> float:
        """The peer process's CPU seconds so far."""

        async def exchange() -> float:
            await self._endpoint.send_obj(raw_command(OP_CPU))
            return float(json.loads(bytes(await self._endpoint.recv_obj())))

        return await asyncio.wait_for(exchange(), self._timeout_s)

    async def close(self) -> None:
        await self._endpoint.close()
