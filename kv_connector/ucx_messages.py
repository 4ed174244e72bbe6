"""How the UCX connector's messages travel on a ucxx endpoint: header framing, the chunk
plan and chunk tags, and dropping a connection in the middle of a pull.

Headers keep ucxx's ``send_obj`` framing (an 8-byte native-endian size, then the JSON
body) so that a peer of the former protocol reads them and refuses clearly, but both
parts are posted at once on each side, and a size over ``MAX_HEADER_BYTES`` is refused
before anything is allocated (``recv_obj`` allocates whatever size the peer names).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kv_connector.wire import MAX_HEADER_BYTES, PullReply, PullRequest, WireError, encode

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How a pull's blocks are cut into chunks: ``blocks_per_chunk`` at a time, in order (the last may hold fewer)."""

    num_blocks: int
    blocks_per_chunk: int

    @property
    def num_chunks(self) -> int:
        return -(-self.num_blocks // self.blocks_per_chunk)

    def bounds(self, chunk: int) -> tuple[int, int]:
        """[start, stop) of chunk ``chunk`` in the pull's block list."""
        start = chunk * self.blocks_per_chunk
        return start, min(start + self.blocks_per_chunk, self.num_blocks)


def chunk_tag(pull_number: int, chunk: int) -> int:
    # ucxx hashes a user tag with the connection's own, so chunk tags never match the
    # untagged header messages, nor another connection's chunks.
    return (pull_number << 32) | chunk


def wire_buffer(tensor: torch.Tensor) -> object:
    """A zero-copy view UCX can send from or receive into: host tensors as uint8 numpy arrays
    (numpy has no bfloat16), device tensors through __cuda_array_interface__."""
    if tensor.device.type == "cpu":
        return tensor.view(torch.uint8).numpy()
    return tensor.view(torch.uint8)


def send_header(endpoint, message: PullRequest | PullReply) -> asyncio.Future:  # noqa: ANN001 - ucxx endpoint
    """Post a header as ucxx's ``send_obj`` frames it (an 8-byte size, then the JSON body), both
    messages at once: ``send_obj`` waits for the first to complete before posting the second."""
    body = np.frombuffer(bytearray(encode(message)), dtype=np.uint8)
    size = np.array([body.nbytes], dtype=np.uint64)
    return asyncio.gather(endpoint.send(size), endpoint.send(body))


async def recv_header(endpoint, buffer: np.ndarray) -> bytes:  # noqa: ANN001 - ucxx endpoint
    """Receive one header framed as :func:`send_header` frames it. Both receives are posted at
    once, the body's into ``buffer`` (``MAX_HEADER_BYTES``, reused): a larger header fails there."""
    size = np.zeros(1, dtype=np.uint64)
    size_received = asyncio.ensure_future(endpoint.recv(size))
    body_received = asyncio.ensure_future(endpoint.recv(buffer))
    try:
        await size_received
        num_bytes = int(size[0])
        if not 0 < num_bytes <= buffer.nbytes:
            raise WireError(f"header of {num_bytes} bytes (at most {buffer.nbytes})")
        await body_received
    except BaseException:
        await cancel_tasks([size_received, body_received])
        raise
    return buffer[:num_bytes].tobytes()


def header_buffer() -> np.ndarray:
    """A reusable buffer for :func:`recv_header`."""
    return np.empty(MAX_HEADER_BYTES, dtype=np.uint8)  # pages are touched only as far as headers reach


async def cancel_tasks(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def abandon(endpoint, tasks: list[asyncio.Future]) -> None:  # noqa: ANN001 - ucxx endpoint
    """Drop a connection mid-transfer. The tasks awaiting its requests are cancelled and
    finished first (a ucxx receive that sees its endpoint close would otherwise fall back to
    receiving a queued message on the worker), then closing cancels the requests still posted."""
    await cancel_tasks(tasks)
    try:
        await endpoint.close()
    except Exception:  # noqa: BLE001 - closing a broken endpoint may itself fail; nothing is left to do
        logger.debug("closing a UCX endpoint failed", exc_info=True)
