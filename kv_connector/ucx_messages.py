"""How the UCX connector's messages travel on a ucxx endpoint: header framing, how a
pull is cut into block messages and how they are tagged, and dropping a connection in
the middle of a pull.

A header is one message: its JSON body's size (8 bytes, little-endian), then the body,
received into a buffer made once per connection (``recv_obj`` would allocate whatever
size the peer names). One message rather than ucxx's ``send_obj`` pair saves a
completion, and an event-loop wake-up, on each side of every pull. Both sides must run
the same protocol version (:data:`~kv_connector.wire.PROTOCOL_VERSION`): a peer of
protocol 1 sends its header as two messages, which this side refuses as not JSON.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kv_connector.wire import MAX_HEADER_BYTES, PullReply, PullRequest, WireError, encode

# ucxx ships no type information: its endpoints and listeners are Any to the type checker.
Endpoint = Any
# What UCX sends from or receives into: host bytes as a uint8 numpy array, device bytes as a uint8 tensor.
WireBuffer = np.ndarray | torch.Tensor

logger = logging.getLogger(__name__)

_SIZE_BYTES = 8  # a header's size prefix
# How long closing an endpoint may wait on each of its internal operations (ucxx's ``period``, in
# ns; a close makes about two). ucxx's default, 10 s, blocks the event loop that long per
# operation when the peer is slow to take part, and an instance's stop closes every connection
# it holds in turn: a SIGTERM'd instance could outlast its orchestrator's stop timeout on them.
ENDPOINT_CLOSE_PERIOD_NS = 500_000_000


def plan_messages(remote_blocks: Sequence[int], local_blocks: Sequence[int], max_blocks: int) -> list[int]:
    """Block counts of a pull's messages, in order. A message is a run of blocks that are
    consecutive on both sides, so it is one contiguous span of each cache (the cache is
    block-major), sent and received in place; at most ``max_blocks`` per message."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    counts: list[int] = []
    for index in range(len(remote_blocks)):
        extends = (
            index > 0
            and counts[-1] < max_blocks
            and remote_blocks[index] == remote_blocks[index - 1] + 1
            and local_blocks[index] == local_blocks[index - 1] + 1
        )
        if extends:
            counts[-1] += 1
        else:
            counts.append(1)
    return counts


def message_spans(block_ids: Sequence[int], message_blocks: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(first block id, number of blocks) of each message, on the side whose ``block_ids`` these are."""
    first = 0
    for count in message_blocks:
        yield block_ids[first], count
        first += count


def consecutive_runs_error(block_ids: Sequence[int], message_blocks: Sequence[int]) -> str | None:
    """Why ``message_blocks`` does not cut ``block_ids`` into runs of consecutive ids, or None if it does."""
    if sum(message_blocks) != len(block_ids):
        return f"messages of {sum(message_blocks)} blocks in all for {len(block_ids)} blocks"
    first = 0
    for index, count in enumerate(message_blocks):
        run = block_ids[first : first + count]
        if any(block != run[0] + offset for offset, block in enumerate(run)):
            return f"message {index} names blocks {list(run)}, which are not consecutive"
        first += count
    return None


def message_tag(pull_number: int, message: int) -> int:
    # ucxx hashes a user tag with the connection's own, so message tags never match the
    # untagged header messages, nor another connection's messages.
    return (pull_number << 32) | message


def wire_buffer(tensor: torch.Tensor) -> WireBuffer:
    """A zero-copy view of a contiguous tensor's bytes that UCX can send from or receive into:
    host tensors as uint8 numpy arrays (numpy has no bfloat16), device tensors through
    __cuda_array_interface__."""
    flat = tensor.view(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def send_header(endpoint, message: PullRequest | PullReply) -> asyncio.Future:
    """Post a header as one message: the body's size, then the JSON body."""
    body = encode(message)
    frame = np.empty(_SIZE_BYTES + len(body), dtype=np.uint8)
    frame[:_SIZE_BYTES] = np.frombuffer(len(body).to_bytes(_SIZE_BYTES, "little"), dtype=np.uint8)
    frame[_SIZE_BYTES:] = np.frombuffer(body, dtype=np.uint8)
    return asyncio.ensure_future(endpoint.send(frame))


async def recv_header(endpoint, buffer: np.ndarray) -> bytes:
    """Receive one header (as :func:`send_header` frames it) into ``buffer`` (from
    :func:`header_buffer`, reused). The buffer's size is the cap: UCX fails a larger message
    as truncated, without copying it, which raises :class:`WireError` here before anything
    is parsed; so does a size prefix past the buffer.

    UCX accepts a message shorter than the buffer without saying how long it was, so the
    bytes past it are whatever the buffer held. The buffer is zeroed as far as each header
    reached once it is read, so a message shorter than the size it claims decodes as NUL
    bytes, which no JSON parser accepts, never as an earlier header."""
    from ucxx.exceptions import UCXMessageTruncatedError

    try:
        await endpoint.recv(buffer)
    except UCXMessageTruncatedError:
        raise WireError(f"a header longer than {buffer.nbytes - _SIZE_BYTES} bytes") from None
    num_bytes = int.from_bytes(buffer[:_SIZE_BYTES].tobytes(), "little")
    if not 0 < num_bytes <= buffer.nbytes - _SIZE_BYTES:
        buffer[:_SIZE_BYTES] = 0
        raise WireError(f"header of {num_bytes} bytes (at most {buffer.nbytes - _SIZE_BYTES})")
    end = _SIZE_BYTES + num_bytes
    data = buffer[_SIZE_BYTES:end].tobytes()
    buffer[:end] = 0
    return data


def header_buffer(max_header_bytes: int = MAX_HEADER_BYTES) -> np.ndarray:
    """A reusable buffer for :func:`recv_header` of headers up to ``max_header_bytes``, all zeros
    (its pages are touched only as far as headers reach)."""
    return np.zeros(_SIZE_BYTES + max_header_bytes, dtype=np.uint8)


async def cancel_tasks(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def abandon(endpoint, tasks: list[asyncio.Future]) -> None:
    """Drop a connection mid-transfer. The tasks awaiting its requests are cancelled and
    finished first (a ucxx receive that sees its endpoint close would otherwise fall back to
    receiving a queued message on the worker), then closing cancels the requests still posted."""
    await cancel_tasks(tasks)
    try:
        await endpoint.close(period=ENDPOINT_CLOSE_PERIOD_NS)
    except Exception:
        logger.debug("closing a UCX endpoint failed", exc_info=True)
