"""One rank's place in an instance's tensor-parallel group: the collectives the sharded model
runs, through ``torch.distributed`` (gloo on CPU, NCCL on GPUs), each bounded by a timeout.

The process group is built directly on a ``TCPStore`` rather than as torch's default group,
so that a process may hold several engines (tests do) and tear each one's group down alone.
Every rank runs on one host; the store listens on loopback only. On CPUs, collectives that fit
go through shared memory instead (``shared_memory_collectives.py``: gloo's loopback TCP took
three quarters of a TP=2 decode step), gloo taking the rest.

A rank that dies fails its peers' next collective at once (gloo reports the closed
connection), or after ``timeout_s`` where a peer hangs instead: the engine thread then fails
its step, and the instance turns NOT_SERVING instead of hanging in a collective.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.tensor_parallel.shared_memory_collectives import SharedMemoryCollectives

# The longest a collective waits for a peer. Peers compute the same step in step, so a wait
# is the imbalance between ranks, not a step's length; this bounds a hang, not normal work.
COLLECTIVE_TIMEOUT_S = 120.0
STORE_TIMEOUT_S = 300.0  # ranks load their shards before they join


class TensorParallelGroup:
    """The collectives of one rank. Rank 0 (the engine's own process) hosts the store."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store_port: int,
        device: torch.device,
        store: dist.TCPStore | None = None,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        prefix: str = "",
    ) -> None:
        """Blocks until every rank has joined. ``store``: rank 0 passes the one it made (see
        :func:`host_store`); the other ranks connect to ``store_port``. ``prefix``: the group's
        keys in the store (each pipeline stage's group has its own in one store)."""
        self.rank, self.world_size = rank, world_size
        if store is None:
            store = dist.TCPStore(
                "127.0.0.1", store_port, world_size, False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
            )
        group_store: dist.Store = dist.PrefixStore(prefix, store) if prefix else store
        self._store = group_store
        # Seconds this rank has spent in the model's collectives (waiting for its peers
        # included): what tensor parallelism costs a step, read by microbench/tensor_parallel.py.
        self.collective_seconds = 0.0
        timeout = datetime.timedelta(seconds=timeout_s)
        self._group: dist.ProcessGroup
        if device.type == "cuda":  # written for GPUs, untested where none is lent
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(group_store, rank, world_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            options._timeout = timeout
            self._group = dist.ProcessGroupGloo(group_store, rank, world_size, options)
        self._shared: SharedMemoryCollectives | None = None
        if device.type == "cpu" and world_size > 1:
            self._shared = SharedMemoryCollectives.join(group_store, rank, world_size, self._barrier, timeout_s)

    def watch_peers(self, peers_alive: Callable[[], bool]) -> None:
        """How a collective waiting in shared memory learns to give up: on rank 0, that a worker
        has died; on a worker, that rank 0 says stop or is gone."""
        if self._shared is not None:
            self._shared.peers_alive = peers_alive

    def close(self) -> None:
        """Rank 0, closing: release workers still waiting in a shared-memory collective."""
        if self._shared is not None:
            self._shared.close()

    def _barrier(self) -> None:
        self._group.allreduce([torch.zeros(1)]).wait()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        started = time.perf_counter()
        if self._shared is None or not self._shared.all_reduce(tensor):
            self._group.allreduce([tensor]).wait()
        self.collective_seconds += time.perf_counter() - started
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` ([..., n], the same shape on each), side by side in rank order:
        [..., world_size * n]."""
        started = time.perf_counter()
        gathered = self._shared.all_gather_last_dim(tensor) if self._shared is not None else None
        if gathered is None:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self._group.allgather([parts], [tensor.contiguous()]).wait()
            gathered = torch.cat(parts, dim=-1)
        self.collective_seconds += time.perf_counter() - started
        return gathered

    def all_reduce_min(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (KV blocks each can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self._group.allreduce([tensor], dist.AllreduceOptions(reduceOp=dist.ReduceOp.MIN)).wait()
        return int(tensor.item())


def host_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store, on a free loopback port (``.port``), not waiting for the others yet."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        True,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )
