"""All-reduce and all-gather between the CPU ranks of one host through shared memory.

gloo moves a collective over TCP on loopback and wakes each peer through the kernel, and a
30-layer model runs 61 collectives a token, so TP=2 spent most of each step waiting
(docs/benchmarks.md, "Tensor parallelism on one CPU host"). Ranks on one host can instead write
their parts into one shared segment and spin on each other's flags, as vLLM's CPU backend does:
a rank that has its own core sees its peer's part within microseconds.

The segment (a file in /dev/shm, unlinked as soon as every rank has mapped it, so nothing
outlives the instance) holds a 64-byte flag line per rank, an abort word, and two sets of one
slot per rank. Collective number ``n`` (every rank runs the same collectives in the same
order) uses set ``n % 2``: a rank writes its part into its slot, raises its flag to ``n``
(release order), waits until every flag reaches ``n`` (acquire order; engine/csrc/rank_flags.c),
then reads every slot. Two sets are enough: a rank writing set ``n % 2`` for collective ``n``
has seen every flag reach ``n - 1``, so every rank has finished reading that set for ``n - 2``.

Every rank sums the slots in rank order, so all ranks hold bit-identical results, as gloo
gives. A tensor larger than a slot returns False / None and the caller uses gloo instead;
the choice depends on the shape alone, which every rank shares.

A wait gives up after the collective timeout, at once when rank 0 raises the abort word
(closing), and as soon as ``peers_alive`` says so (rank 0: a worker has died; a worker: rank 0
has sent something, which mid-collective can only be a stop, or is gone), so a dead rank fails
the step instead of hanging it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from engine import cpu_kernels

logger = logging.getLogger(__name__)

_FLAG_LINE = 64  # bytes: each rank's flag on its own cache line
_HEADER = 4096  # the flag lines and the abort word, then the slots
_SEGMENT_BUDGET = 32 << 20  # bytes of shared memory for both sets of every rank's slot
_MAX_SLOT_BYTES = 8 << 20
_WAIT_SLICE_NS = 50_000_000  # between rank 0's checks that its workers live
_STORE_KEY = "shared_memory_collectives"
_SHM_DIR = Path("/dev/shm")


class SharedMemoryCollectives:
    """One rank's end of the segment. Build it with :meth:`join` on every rank at once."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        segment: mmap.mmap,
        slot_bytes: int,
        kernels: cpu_kernels.CPUKernels,
        timeout_s: float,
    ) -> None:
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self._segment = segment  # keeps the mapping alive as long as the views
        self._bytes = torch.frombuffer(segment, dtype=torch.uint8)
        self._base = self._bytes.data_ptr()
        self._words = self._bytes[:_HEADER].view(torch.int64)
        self._raise = kernels.bind("rank_flag_raise", None, [ctypes.c_void_p, ctypes.c_int64])
        self._wait = kernels.bind(
            "rank_flags_wait",
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64],
        )
        self._timeout_s = timeout_s
        self._count = 0  # collectives run so far
        self._views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}  # (set, dtype, bytes) -> slots
        # Rank 0 learns here when one of its workers has died (set by the executor).
        self.peers_alive: Callable[[], bool] = lambda: True

    @classmethod
    def join(
        cls, store: dist.Store, rank: int, world_size: int, barrier: Callable[[], None], timeout_s: float
    ) -> SharedMemoryCollectives | None:
        """Rank 0 creates the segment and names it in the group's store; every rank maps it;
        after ``barrier`` (a collective of the group's) rank 0 unlinks the file. None, on every
        rank alike, where the kernels or the segment are unavailable: gloo alone then."""
        kernels = cpu_kernels.load()
        slot_bytes = min(_MAX_SLOT_BYTES, _SEGMENT_BUDGET // (2 * world_size)) // 64 * 64
        path = ""
        if rank == 0:
            path = create_segment(_HEADER + 2 * world_size * slot_bytes, "tp") if kernels is not None else ""
            store.set(_STORE_KEY, path)
        else:
            path = store.get(_STORE_KEY).decode()
        segment = None
        if path:
            with open(path, "r+b") as file:
                segment = mmap.mmap(file.fileno(), 0)
        try:
            barrier()
        finally:  # also when a rank never comes: no segment outlives the group's start
            if rank == 0 and path:
                os.unlink(path)
        if segment is None or kernels is None:
            return None
        return cls(rank, world_size, segment, slot_bytes, kernels, timeout_s)

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` over the ranks, in place. False (nothing done) if it exceeds a slot or
        is not contiguous (the same on every rank: the model's partial sums are contiguous)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes or not tensor.is_contiguous():
            return False
        parts = self._exchange(tensor, nbytes)
        flat = tensor.view(-1)
        if self.world_size == 2:
            torch.add(parts[0], parts[1], out=flat)
        else:
            flat.copy_(parts[0])
            for part in parts[1:]:
                flat.add_(part)
        return True

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``tensor`` side by side in rank order, [..., world_size * n]; None if
        it exceeds a slot."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes:
            return None
        parts = self._exchange(tensor, nbytes)
        return torch.cat([part.view(tensor.shape) for part in parts], dim=-1)

    def close(self) -> None:
        """Rank 0, closing: release every rank still waiting in a collective."""
        self._words[self._abort_word].fill_(1)

    # ------------------------------------------------------------------ internals

    @property
    def _abort_word(self) -> int:
        return self.world_size * _FLAG_LINE // 8

    def _exchange(self, tensor: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        """Write this rank's part, raise its flag, wait for every rank's; the parts, as views
        of ``tensor``'s dtype and size into the shared slots."""
        self._count += 1
        count = self._count
        key = (count % 2, tensor.dtype, nbytes)
        parts = self._views.get(key)
        if parts is None:  # a decode step repeats a handful of shapes: views made once each
            slots = _HEADER + (count % 2) * self.world_size * self.slot_bytes
            parts = [
                self._bytes[start : start + nbytes].view(tensor.dtype)
                for start in range(slots, slots + self.world_size * self.slot_bytes, self.slot_bytes)
            ]
            self._views[key] = parts
        parts[self.rank].view(tensor.shape).copy_(tensor)
        self._raise(self._base + self.rank * _FLAG_LINE, count)
        self._wait_for_all(count)
        return parts

    def _wait_for_all(self, count: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        abort = self._base + self._abort_word * 8
        while True:
            outcome = self._wait(self._base, _FLAG_LINE // 8, self.world_size, count, abort, _WAIT_SLICE_NS)
            if outcome == 0:
                return
            if outcome == 1:
                raise RuntimeError("the tensor-parallel group is closing: collective abandoned")
            # The peers may all have arrived while this rank was descheduled after its slice, and
            # rank 0 sent the next step since: a last look at the flags before giving up.
            if not self.peers_alive() and self._wait(self._base, _FLAG_LINE // 8, self.world_size, count, abort, 0):
                raise RuntimeError("a tensor-parallel rank died, or rank 0 stopped: collective abandoned")
            if time.monotonic() > deadline:
                raise RuntimeError(f"a tensor-parallel collective waited {self._timeout_s:.0f} s for a peer: giving up")


def create_segment(size: int, purpose: str) -> str:
    """A file of ``size`` bytes, its blocks reserved (a full /dev/shm fails here, not later
    with SIGBUS); its path, or "" if none can be made. ``purpose`` goes into its name (``tp``:
    these collectives; ``pp``: engine/pipeline_parallel/activation_channel.py)."""
    directory = _SHM_DIR if _SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    path = directory / f"splitserve-{purpose}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as error:
        logger.warning("no shared memory segment for %s (%s)", purpose, error)
        path.unlink(missing_ok=True)
        return ""
    return str(path)
