"""A step's activations (hidden states and residual) from one pipeline stage's process to the
next one's, on one host: the bytes through shared memory, the doorbell through a pipe.

Every stage gets the step's flat batch from the engine (rank 0's pipe), so both ends know the
token count; only the two ``[num_tokens, hidden_size]`` tensors cross. They go through a
shared segment of two slots (message ``n`` in slot ``n % 2``) sized for the step budget
(``max_num_batched_tokens``), and the pipe carries only a message's number one way and its
acknowledgement back. A pipe rather than flags in shared memory: a stage waits for its
predecessor's whole share of the step, milliseconds to seconds, and a blocking read sleeps
there where a spin would take the core from a rank that shares it; and when the process at
the other end dies the pipe reports it at once (end of file).

In call order:

1. :meth:`ActivationSender.create` (the earlier stage, once its model is loaded): make the
   segment, map it, send its path over the pipe.
2. :meth:`ActivationReceiver.connect` (the later stage): read the path, map the segment and
   unlink its file, so nothing is left in /dev/shm once both ends are gone (the sender unlinks
   it too on closing, for a receiver that never came).
3. Each step, :meth:`ActivationSender.send`: wait until the slot's previous message was read
   (its acknowledgement), copy the two tensors in, ring (the message's number).
   :meth:`ActivationReceiver.receive`: wait for the ring, copy the tensors out, acknowledge.

Waiting is the caller's ``wait_readable``: a worker also watches the engine's pipe (to stop
when told), the engine watches its workers' liveness, so a dead stage fails the step at once.
On a GPU the slots are host memory: the tensors are copied through it (written for GPUs,
untested where none is lent).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.tensor_parallel.shared_memory_collectives import create_segment

# Block until the connection can be read (a message, or end of file), or raise: the caller's
# way of giving up (a stop from the engine, a dead peer, a timeout).
WaitReadable = Callable[[Connection], None]

_NUMBER = struct.Struct("<q")
_HEADER = struct.Struct("<qq")  # max_tokens, hidden_size; then the dtype's name and the path
_NUM_SLOTS = 2
_ALIGN = 64


class StageGone(RuntimeError):
    """The process at the other end of a channel exited (its pipe reached end of file)."""


class _Channel:
    def __init__(
        self,
        conn: Connection,
        segment: mmap.mmap,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        wait_readable: WaitReadable,
        peer: str,
        path: str | None = None,
    ) -> None:
        self._conn = conn
        self._path = path  # the segment's file while it may still exist (the sender's)
        self._segment = segment  # keeps the mapping alive as long as the views
        self.max_tokens, self.hidden_size, self.dtype = max_tokens, hidden_size, dtype
        self._wait_readable = wait_readable
        self.peer = peer  # names the other end in errors
        self._tensor_bytes = max_tokens * hidden_size * dtype.itemsize
        self._bytes = torch.frombuffer(segment, dtype=torch.uint8)
        self._count = 0  # messages sent, or received

    def _views(self, slot: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s hidden states and residual for ``num_tokens`` tokens."""
        if num_tokens > self.max_tokens:
            raise RuntimeError(
                f"bug: a step of {num_tokens} tokens is more than the activation channel's {self.max_tokens}"
            )
        start = slot * 2 * self._tensor_bytes
        size = num_tokens * self.hidden_size * self.dtype.itemsize
        hidden = self._bytes[start : start + size].view(self.dtype).view(num_tokens, self.hidden_size)
        start += self._tensor_bytes
        residual = self._bytes[start : start + size].view(self.dtype).view(num_tokens, self.hidden_size)
        return hidden, residual

    def _read_number(self) -> int:
        self._wait_readable(self._conn)
        try:
            message = self._conn.recv_bytes()
        except (EOFError, OSError):
            raise StageGone(f"{self.peer} is gone") from None
        return int(_NUMBER.unpack(message)[0])

    def _write_number(self, number: int) -> None:
        try:
            self._conn.send_bytes(_NUMBER.pack(number))
        except OSError:
            raise StageGone(f"{self.peer} is gone") from None

    def close(self) -> None:
        self._conn.close()
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)


class ActivationSender(_Channel):
    """The earlier stage's end."""

    _num_acknowledged = 0

    @classmethod
    def create(
        cls,
        conn: Connection,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        wait_readable: WaitReadable,
        peer: str,
    ) -> ActivationSender:
        """Make the segment for steps of up to ``max_tokens`` tokens and name it to the
        receiver; returns at once (the receiver maps it when it connects)."""
        tensor_bytes = max_tokens * hidden_size * dtype.itemsize
        size = _NUM_SLOTS * 2 * -(-tensor_bytes // _ALIGN) * _ALIGN
        path = create_segment(size, "pp")
        if not path:
            raise RuntimeError("pipeline parallel: no shared memory for the activations (see the warning above)")
        try:
            with open(path, "r+b") as file:
                segment = mmap.mmap(file.fileno(), 0)
            dtype_name = str(dtype).removeprefix("torch.")
            conn.send_bytes(_HEADER.pack(max_tokens, hidden_size) + f"{dtype_name}\n{path}".encode())
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise
        return cls(conn, segment, max_tokens, hidden_size, dtype, wait_readable, peer, path=path)

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand ``hidden`` and ``residual`` ([num_tokens, hidden_size] each) to the next stage."""
        if hidden.dtype != self.dtype or residual.dtype != self.dtype:
            raise RuntimeError(f"bug: activations in {hidden.dtype}/{residual.dtype}, the channel carries {self.dtype}")
        number = self._count
        while self._num_acknowledged < number - _NUM_SLOTS + 1:  # the slot's previous message is read
            acknowledged = self._read_number()
            if acknowledged != self._num_acknowledged:
                raise RuntimeError(f"bug: acknowledgement {acknowledged}, expected {self._num_acknowledged}")
            self._num_acknowledged += 1
        hidden_slot, residual_slot = self._views(number % _NUM_SLOTS, hidden.shape[0])
        hidden_slot.copy_(hidden)
        residual_slot.copy_(residual)
        self._write_number(number)
        self._count += 1


class ActivationReceiver(_Channel):
    """The later stage's end."""

    @classmethod
    def connect(cls, conn: Connection, wait_readable: WaitReadable, peer: str) -> ActivationReceiver:
        """Map the segment the sender named (waiting for it) and unlink its file."""
        wait_readable(conn)
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            raise StageGone(f"{peer} exited while starting (its log says why)") from None
        max_tokens, hidden_size = _HEADER.unpack_from(message)
        dtype_name, path = message[_HEADER.size :].decode().split("\n", 1)
        dtype = getattr(torch, dtype_name)
        with open(path, "r+b") as file:
            segment = mmap.mmap(file.fileno(), 0)
        os.unlink(path)
        return cls(conn, segment, max_tokens, hidden_size, dtype, wait_readable, peer)

    def receive(self, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states and residual for this step's ``num_tokens`` tokens,
        copied out of the slot (which is then acknowledged, free for the sender)."""
        number = self._read_number()
        if number != self._count:
            raise RuntimeError(f"bug: activation message {number}, expected {self._count}")
        hidden_slot, residual_slot = self._views(number % _NUM_SLOTS, num_tokens)
        hidden = torch.empty_like(hidden_slot, device=device).copy_(hidden_slot)
        residual = torch.empty_like(residual_slot, device=device).copy_(residual_slot)
        # The slot is free again. A sender gone by now has had what it sent: this step's
        # activations are whole, and the next receive reports its end of file.
        with contextlib.suppress(OSError):
            self._conn.send_bytes(_NUMBER.pack(number))
        self._count += 1
        return hidden, residual
