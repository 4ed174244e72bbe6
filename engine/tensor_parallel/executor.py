"""Rank 0's side of an instance's tensor-parallel group: the worker processes of ranks
1..N-1 and the step inputs it sends them.

An instance at ``--tensor-parallel-size N`` is N processes: the engine's own, rank 0, which
schedules, holds its shard of the model and samples (it alone has the sampler and the
requests), and N-1 workers (engine/tensor_parallel/worker.py), each holding its shard and
its heads' KV blocks. In call order:

1. :meth:`TensorParallelExecutor.start`: host the group's store, spawn the workers (each
   pinned to its own CPUs, or given its own GPU), and join the group with them.
2. Rank 0 loads its shard and sizes the KV cache; :meth:`share_num_blocks` sends every worker
   the block count, which each allocates before answering ready. The block table is rank 0's
   and one for all: a block id means the same block on every rank, holding each rank's heads.
3. Each step, :meth:`send_step` writes the step's flat batch to every worker's pipe (raw
   int64 words, engine/tensor_parallel/messages.py), then every rank runs its forward pass;
   the all-reduces and the logits gather inside it are where the ranks meet.
4. :meth:`close`: ``STOP`` to each worker, then join, and kill one that does not exit.

A worker that dies fails rank 0's next collective at once (or its pipe write), so the step
raises, the engine's step loop ends, and the instance answers NOT_SERVING; the workers left
exit when their pipe or a collective fails, and die with rank 0 in any case.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.flat_batch import FlatBatch
from engine.tensor_parallel import messages
from engine.tensor_parallel.group import TensorParallelGroup, host_store
from engine.tensor_parallel.worker import WorkerSpec, main

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a worker told to stop that has not exited by then is killed


class TensorParallelExecutor:
    def __init__(
        self,
        group: TensorParallelGroup,
        workers: list[tuple[BaseProcess, Connection]],
        extension_channels: list[Connection],
    ) -> None:
        self.group = group  # rank 0's
        self._workers = workers
        # Rank 0's ends of the worker extension's channels, ranks 1..N-1 in order (none without one).
        self.extension_channels = extension_channels
        self._closed = False
        group.watch_peers(lambda: all(process.is_alive() for process, _ in workers))

    @classmethod
    def start(cls, config: EngineConfig, model_path: Path, device: torch.device) -> TensorParallelExecutor:
        """Spawn ranks 1..N-1 and join the group with them (rank 0 is this process, on ``device``)."""
        world_size = config.tensor_parallel_size
        store = host_store(world_size)
        cpus = split_cpus(sorted(os.sched_getaffinity(0)), world_size) if device.type == "cpu" else None
        if cpus is not None:
            torch.set_num_threads(len(cpus[0]))  # rank 0's share; its process keeps its affinity
        context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        workers = []
        extension_channels = []
        for rank in range(1, world_size):
            parent, child = context.Pipe()
            extension_parent, extension_child = context.Pipe() if config.worker_extension else (None, None)
            spec = WorkerSpec(
                config=replace(config),
                model_path=model_path,
                rank=rank,
                store_port=store.port,
                device=f"cuda:{rank}" if device.type == "cuda" else "cpu",
                cpus=frozenset(cpus[rank]) if cpus is not None else None,
                log_level=logging.getLogger().getEffectiveLevel(),
            )
            process = context.Process(
                target=main, args=(spec, child, extension_child), name=f"tp-rank{rank}", daemon=True
            )
            process.start()
            child.close()
            workers.append((process, parent))
            if extension_parent is not None and extension_child is not None:
                extension_child.close()
                extension_channels.append(extension_parent)
        logger.info(
            "tensor parallel: %d ranks, workers %s%s",
            world_size,
            ", ".join(str(process.pid) for process, _ in workers),
            f", CPUs {[sorted(c) for c in cpus]}" if cpus is not None else "",
        )
        try:
            group = TensorParallelGroup(0, world_size, store.port, device, store=store)
        except BaseException:
            _stop(workers)
            raise
        return cls(group, workers, extension_channels)

    def share_num_blocks(self, num_blocks: int) -> None:
        """Every worker allocates ``num_blocks`` KV blocks; returns once all have."""
        for _, conn in self._workers:
            conn.send_bytes(messages.encode_words(messages.INIT, num_blocks))
        for rank, (_, conn) in enumerate(self._workers, start=1):
            try:
                answer = conn.recv_bytes()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (its log says why)") from None
            if messages.kind_of(answer) == messages.FAILED:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {messages.failure_text(answer)}")

    def send_step(self, batch: FlatBatch) -> None:
        """The step's inputs to every worker, before rank 0's own forward pass."""
        message = messages.encode_step(batch)
        for rank, (process, conn) in enumerate(self._workers, start=1):
            try:
                conn.send_bytes(message)
            except OSError:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) is gone (exit code {process.exitcode})"
                ) from None

    def close(self) -> None:
        """Stop every worker (idempotent); kills one that does not exit in time."""
        if not self._closed:
            self._closed = True
            self.group.close()  # workers waiting in a collective give up on it, and read STOP
            _stop(self._workers)
            for channel in self.extension_channels:
                channel.close()


def _stop(workers: list[tuple[BaseProcess, Connection]]) -> None:
    for _, conn in workers:
        with contextlib.suppress(OSError):
            conn.send_bytes(messages.encode_words(messages.STOP))
    for process, conn in workers:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            logger.warning("tensor-parallel worker %s did not stop: killing it", process.pid)
            process.kill()
            process.join()
        conn.close()


def split_cpus(cpus: list[int], world_size: int) -> list[set[int]]:
    """Each rank's CPUs: consecutive equal shares when there are enough, else one each, reused
    round robin (ranks then share cores: correct, not fast)."""
    if len(cpus) >= world_size:
        share = len(cpus) // world_size
        return [set(cpus[rank * share : (rank + 1) * share]) for rank in range(world_size)]
    logger.warning(
        "tensor parallel: %d ranks on %d CPUs, so ranks share CPUs (correct, slower than fewer ranks)",
        world_size,
        len(cpus),
    )
    return [{cpus[rank % len(cpus)]} for rank in range(world_size)]
