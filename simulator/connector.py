"""The KV connector of simulated instances: the control part of a pull is real, the bytes are
a wait.

A real pull reaches P's connector, presents the request's pull token, and copies the blocks.
Here D opens a TCP connection to the address in the KV handle, sends one line naming the
request, its pull token and the blocks it wants, and P answers whether it publishes them
under that token (compared in constant time); then D waits what the profile says moving
those blocks' bytes (the profile's model's) over the link takes, and reports those bytes. So a pull from a
prefill instance that is gone, that never published the request, or that released it fails
as a real one does, and pull time follows bytes and link bandwidth.

P treats every connection as untrusted: one line of bounded length within a deadline, else
the connection is closed without an answer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

import torch

from kv_connector.base import KVConnector, KVSource, KVTransferError, PublishedKV, TransferStats
from kv_connector.fingerprint import Fingerprint
from simulator.timing_model import TimingProfile

logger = logging.getLogger(__name__)

MAX_REQUEST_LINE_BYTES = 4096  # a request id, a pull token and a count, with room to spare
REQUEST_DEADLINE_S = 5.0  # for a peer to send its one line


class SimulatedConnector(KVConnector):
    name = "simulated"

    def __init__(
        self, kv_cache: torch.Tensor, fingerprint: Fingerprint, profile: TimingProfile, time_scale: float = 1.0
    ) -> None:
        super().__init__(kv_cache, fingerprint)
        self.profile = profile
        self.time_scale = time_scale
        self._published: dict[str, tuple[bytes, int]] = {}  # request id -> (pull token, blocks)
        self._server: asyncio.Server | None = None

    # ------------------------------------------------------------- prefill side

    async def start(self, host: str, port: int) -> str:
        self._server = await asyncio.start_server(self._answer, host, port, limit=MAX_REQUEST_LINE_BYTES)
        bound_port = self._server.sockets[0].getsockname()[1]
        return f"{host}:{bound_port}"

    async def publish(
        self,
        request_id: str,
        block_ids: list[int],
        token_ids: list[int],
        pull_token: bytes | None = None,
        cache_salt: str = "",
    ) -> PublishedKV:
        self.check_block_ids(block_ids)
        self._published[request_id] = (pull_token or b"", len(block_ids))
        return PublishedKV()

    async def unpublish(self, request_id: str, grace_s: float = 0.0) -> None:
        self._published.pop(request_id, None)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), REQUEST_DEADLINE_S)
            writer.write((self._check_pull(line) + "\n").encode())
            await writer.drain()
        except (TimeoutError, ValueError, ConnectionError):
            pass  # silent, oversized or broken: closed without an answer
        finally:
            writer.close()

    def _check_pull(self, line: bytes) -> str:
        """'ok', or why the pull is refused."""
        try:
            asked = json.loads(line)
            request_id, token, num_blocks = (
                str(asked["request_id"]),
                bytes.fromhex(asked["token"]),
                int(asked["blocks"]),
            )
        except (ValueError, KeyError, TypeError):
            return "refused: malformed pull request"
        published = self._published.get(request_id)
        if published is None:
            return f"refused: {request_id} is not published here"
        expected_token, num_published = published
        if not hmac.compare_digest(token, expected_token):
            return "refused: wrong pull token"
        if not 0 <= num_blocks <= num_published:
            return f"refused: {num_blocks} blocks asked of {num_published}"
        return "ok"

    # -------------------------------------------------------------- decode side

    async def pull(
        self, source: KVSource, block_ids: list[int], num_local_hit_blocks: int, timeout_s: float
    ) -> TransferStats:
        self.check_source(source)
        self.check_block_ids(block_ids)
        num_blocks = len(block_ids) - num_local_hit_blocks
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._ask(source, num_blocks), timeout_s)
        except TimeoutError:
            raise KVTransferError(f"the pull of {source.request_id} from {source.address} timed out") from None
        # The simulated model's bytes (the profile's), not the stand-in cache's.
        num_bytes = num_blocks * self.block_size * self.profile.kv_bytes_per_token
        seconds = self.profile.pull_seconds(num_bytes) * self.time_scale
        left = timeout_s - (time.monotonic() - started)
        if seconds > left:
            await asyncio.sleep(max(left, 0.0))
            raise KVTransferError(f"the pull of {source.request_id} from {source.address} timed out")
        await asyncio.sleep(seconds)
        return TransferStats(num_blocks, num_bytes, time.monotonic() - started, num_messages=1 if num_blocks else 0)

    async def _ask(self, source: KVSource, num_blocks: int) -> None:
        host, _, port = source.address.rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port), limit=MAX_REQUEST_LINE_BYTES)
        except (OSError, ValueError) as error:
            raise KVTransferError(
                f"cannot reach the prefill instance's connector at {source.address}: {error}"
            ) from None
        try:
            asked = {"request_id": source.request_id, "token": source.pull_token.hex(), "blocks": num_blocks}
            writer.write((json.dumps(asked) + "\n").encode())
            await writer.drain()
            answer = (await reader.readline()).decode(errors="replace").strip()
        except (OSError, ValueError) as error:
            raise KVTransferError(f"the pull of {source.request_id} from {source.address} broke: {error}") from None
        finally:
            writer.close()
        if answer != "ok":
            raise KVTransferError(f"{source.address} refused the pull of {source.request_id}: {answer or 'no answer'}")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
