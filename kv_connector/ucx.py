"""KV transfer over UCX (ucxx): D connects to P's listener, asks for blocks with a
validated header, and receives them as one raw buffer.

On CPU, UCX moves host memory over shared memory or TCP; on GPU hosts the same
code sends device tensors and UCX picks cuda_ipc, NVLink or RDMA. For speed on
one host set ``UCX_TLS=tcp,sm,self UCX_RNDV_SCHEME=put_zcopy`` (see docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import time

import torch

from kv_connector.base import (
    KVConnector,
    KVSource,
    KVTransferError,
    TransferStats,
    bounded_transfer,
    gather_blocks,
    scatter_blocks,
)
from kv_connector.fingerprint import FingerprintMismatchError
from kv_connector.wire import PullReply, PullRequest, WireError, decode_pull_reply, decode_pull_request, encode

logger = logging.getLogger(__name__)


def _wire_buffer(tensor: torch.Tensor) -> object:
    """A zero-copy view UCX can send from or receive into: host tensors as uint8 numpy arrays
    (numpy has no bfloat16), device tensors through __cuda_array_interface__."""
    if tensor.device.type == "cpu":
        return tensor.view(torch.uint8).numpy()
    return tensor.view(torch.uint8)


class UCXConnector(KVConnector):
    name = "ucx"

    def __init__(self, kv_cache: torch.Tensor, fingerprint) -> None:  # noqa: ANN001 - Fingerprint
        super().__init__(kv_cache, fingerprint)
        self._published: dict[str, frozenset[int]] = {}
        self._listener = None
        self._host = ""

    async def start(self, host: str, port: int) -> str:
        import ucxx

        self._listener = ucxx.create_listener(self._serve, port=port or None)
        self._host = host
        address = f"{host}:{self._listener.port}"
        logger.info("UCX KV connector listening on %s", address)
        return address

    def publish(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> None:
        self._published[request_id] = frozenset(block_ids)

    def unpublish(self, request_id: str) -> None:
        self._published.pop(request_id, None)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # ------------------------------------------------------------ P: serving

    async def _serve(self, endpoint) -> None:  # noqa: ANN001 - ucxx endpoint
        try:
            reply, payload = self._answer(await endpoint.recv_obj())
            await endpoint.send_obj(encode(reply))
            if payload is not None:
                await endpoint.send(_wire_buffer(payload))
        except Exception:  # a broken peer must never take the listener down
            logger.exception("serving a KV pull failed")
        finally:
            await endpoint.close()

    def _answer(self, data: bytes) -> tuple[PullReply, torch.Tensor | None]:
        try:
            request = decode_pull_request(bytes(data))
        except WireError as error:
            return PullReply(ok=False, error=f"bad pull request: {error}"), None
        try:
            self.fingerprint.check_compatible(request.fingerprint, "prefill", "decode")
        except FingerprintMismatchError as error:
            return PullReply(ok=False, error=str(error)), None
        published = self._published.get(request.request_id)
        if published is None:
            return PullReply(ok=False, error=f"no KV published for request {request.request_id!r} (released or expired)"), None
        if not published.issuperset(request.block_ids):
            return PullReply(ok=False, error=f"blocks {sorted(set(request.block_ids) - published)} are not the request's"), None
        payload = gather_blocks(self.kv_cache, request.block_ids)
        return PullReply(ok=True, num_bytes=payload.numel() * payload.element_size(), shape=list(payload.shape), dtype=str(payload.dtype).removeprefix("torch.")), payload

    # ------------------------------------------------------------- D: pulling

    async def pull(self, source: KVSource, block_ids: list[int], first_block: int, timeout_s: float) -> TransferStats:
        remote_blocks = list(source.block_ids[first_block:])
        local_blocks = block_ids[first_block:]
        if len(remote_blocks) != len(local_blocks):
            raise KVTransferError(f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones (bug)")
        if not remote_blocks:
            return TransferStats(num_blocks=0, num_bytes=0, seconds=0.0)
        self.check_source(source)
        start = time.perf_counter()
        staging = await bounded_transfer(
            self._receive(source, remote_blocks), timeout_s, f"pulling {len(remote_blocks)} blocks from {source.address}"
        )
        scatter_blocks(self.kv_cache, local_blocks, staging)
        seconds = time.perf_counter() - start
        return TransferStats(num_blocks=len(local_blocks), num_bytes=staging.numel() * staging.element_size(), seconds=seconds)

    async def _receive(self, source: KVSource, remote_blocks: list[int]) -> torch.Tensor:
        import ucxx

        host, _, port = source.address.rpartition(":")
        endpoint = await ucxx.create_endpoint(host, int(port))
        try:
            await endpoint.send_obj(encode(PullRequest(source.request_id, remote_blocks, self.fingerprint)))
            try:
                reply = decode_pull_reply(bytes(await endpoint.recv_obj()))
            except WireError as error:
                raise KVTransferError(f"prefill instance {source.address} sent {error}") from None
            if not reply.ok:
                raise KVTransferError(f"prefill instance {source.address} refused the pull: {reply.error}")
            layers, kv, _, block_size, heads, head_dim = self.kv_cache.shape
            expected_shape = [layers, kv, len(remote_blocks), block_size, heads, head_dim]
            staging = torch.empty(expected_shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
            expected_bytes = staging.numel() * staging.element_size()
            if reply.shape != expected_shape or reply.num_bytes != expected_bytes:
                raise KVTransferError(
                    f"prefill instance {source.address} offers {reply.shape} ({reply.num_bytes} bytes), "
                    f"expected {expected_shape} ({expected_bytes} bytes)"
                )
            await endpoint.recv(_wire_buffer(staging))
            return staging
        finally:
            await endpoint.close()
