"""Rank 0's side of an instance's ranks: the worker processes of the other ranks and the
step inputs it sends them.

An instance at ``--tensor-parallel-size T`` and ``--pipeline-parallel-size P`` is T x P
processes: P pipeline stages (engine/pipeline_parallel/stages.py: contiguous layers each), each
split over T tensor-parallel ranks with their own collectives. The engine's own process, rank
0, is the last stage's tensor-parallel rank 0: it schedules, holds its shard of the last
stage's layers, and samples (it alone has the sampler and the requests). Every other rank is a
worker (engine/tensor_parallel/worker.py) holding its shard of its stage's layers and their
KV blocks. In call order:

1. :meth:`TensorParallelExecutor.start`: plan the stages (a split the model cannot take is
   refused here, before any process starts), host the stores of the stages' groups, spawn the
   workers (each pinned to its own CPUs, or given its own GPU) with a pipe from each stage's
   rank to the next stage's rank of the same tensor-parallel number, and join the last stage's
   group with its workers.
2. Rank 0 loads its shard and sizes the KV cache; :meth:`share_num_blocks` sends every worker
   the block count, which each allocates before answering ready (having named its activation
   segment to the next stage: engine/pipeline_parallel/activation_channel.py); rank 0 then
   connects to the stage before it. The block table is rank 0's and one for all: a block id
   means the same block on every rank, holding each rank's layers and heads.
3. Each step, :meth:`send_step` writes the step's flat batch to every worker's pipe (raw
   int64 words, engine/tensor_parallel/messages.py), then every rank runs its part
   (engine/pipeline_parallel/stage_step.py): the all-reduces and the logits gather are where a
   stage's ranks meet, the activations where a stage meets the next; rank 0 takes the stage
   before it through :meth:`last_stage_logits`.
4. :meth:`close`: ``STOP`` to each worker, then join, and kill one that does not exit.

A worker that dies fails rank 0's next collective or activation wait at once (or its pipe
write), so the step raises naming the dead rank, the engine's step loop ends, and the instance
answers NOT_SERVING; the workers left exit when their pipe, a collective or a stage link fails,
or when rank 0 tells them to stop, and die with rank 0 in any case.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.flat_batch import FlatBatch
from engine.gguf_files import metadata_folder
from engine.models.llama import LlamaFamilyForCausalLM
from engine.pipeline_parallel.activation_channel import ActivationReceiver, StageGone
from engine.pipeline_parallel.stage_step import run_stage
from engine.pipeline_parallel.stages import PipelineStage, plan_stages
from engine.tensor_parallel import messages
from engine.tensor_parallel.group import TensorParallelGroup, host_store
from engine.tensor_parallel.worker import STAGE_GONE_EXIT_CODE, STAGE_WAIT_TIMEOUT_S, WorkerSpec, main, rank_name

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a worker told to stop that has not exited by then is killed
_LIVENESS_CHECK_S = 0.05  # between rank 0's checks that its workers live, while it waits on a stage


class TensorParallelExecutor:
    def __init__(
        self,
        group: TensorParallelGroup | None,
        workers: list[tuple[BaseProcess, Connection]],
        worker_names: list[str],
        extension_channels: list[Connection],
        stage: PipelineStage,
        inbound_link: Connection | None,
    ) -> None:
        self.group = group  # rank 0's, among its stage's ranks (None: a stage of one rank)
        self._workers = workers
        self._worker_names = worker_names  # each worker's place, as errors name it
        # Rank 0's ends of the worker extension's channels, ranks 1..N-1 in order (none without one).
        self.extension_channels = extension_channels
        self.stage = stage  # the layers rank 0 holds: the last stage's
        self._inbound_link = inbound_link  # from the stage before rank 0's (None: one stage)
        self.inbound: ActivationReceiver | None = None  # connected by share_num_blocks
        self._closed = False
        if group is not None:
            group.watch_peers(lambda: all(process.is_alive() for process, _ in workers))

    @property
    def named_extension_channels(self) -> list[tuple[str, Connection]]:
        """Each worker extension channel, with how errors name the rank at its other end."""
        if not self.extension_channels:  # no worker extension: no channel to name
            return []
        return list(zip(self._worker_names, self.extension_channels, strict=True))

    @classmethod
    def start(cls, config: EngineConfig, model_path: Path, device: torch.device) -> TensorParallelExecutor:
        """Spawn every rank but rank 0 and join the last stage's group with its workers (rank 0
        is this process, on ``device``). Raises ValueError for stages the model cannot take."""
        tensor_size, num_stages = config.tensor_parallel_size, config.pipeline_parallel_size
        num_layers = AutoConfig.from_pretrained(str(metadata_folder(model_path))).num_hidden_layers
        stages = plan_stages(num_layers, num_stages, config.pipeline_stage_layers)
        world_size = tensor_size * num_stages
        # The stages' groups share one store (each under a prefix of its own), hosted here.
        store = host_store(world_size) if tensor_size > 1 else None
        cpus = split_cpus(sorted(os.sched_getaffinity(0)), world_size) if device.type == "cpu" else None
        own = (num_stages - 1) * tensor_size  # rank 0's place in the stage-major order of all ranks
        if cpus is not None:
            torch.set_num_threads(len(cpus[own]))  # rank 0's share; its process keeps its affinity
        context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        # Stage s's rank t hands its output to stage s + 1's rank t: (sender's end, receiver's end).
        links = {(s, t): context.Pipe() for s in range(num_stages - 1) for t in range(tensor_size)}
        workers: list[tuple[BaseProcess, Connection]] = []
        names: list[str] = []
        extension_channels: list[Connection] = []
        for stage in stages:
            for rank in range(tensor_size):
                place = stage.index * tensor_size + rank
                if place == own:
                    continue
                parent, child = context.Pipe()
                extension_parent, extension_child = context.Pipe() if config.worker_extension else (None, None)
                name = rank_name(stage, rank, tensor_size)
                spec = WorkerSpec(
                    config=replace(config),
                    model_path=model_path,
                    rank=rank,
                    stage=stage,
                    store_port=store.port if store is not None else 0,
                    # Rank 0 has the first GPU; the others follow it in stage-major order.
                    device=f"cuda:{(place - own) % world_size}" if device.type == "cuda" else "cpu",
                    cpus=frozenset(cpus[place]) if cpus is not None else None,
                    log_level=logging.getLogger().getEffectiveLevel(),
                    name=name,
                )
                inbound = links[(stage.index - 1, rank)][1] if not stage.is_first else None
                outbound = links[(stage.index, rank)][0] if not stage.is_last else None
                process = context.Process(
                    target=main,
                    args=(spec, child, extension_child, inbound, outbound),
                    name=name.replace(" ", "-"),
                    daemon=True,
                )
                process.start()
                child.close()
                workers.append((process, parent))
                names.append(name)
                if extension_parent is not None and extension_child is not None:
                    extension_child.close()
                    extension_channels.append(extension_parent)
        # Each link end now lives in its worker alone, so a worker's death is its peer's end of file.
        inbound_link = links[(num_stages - 2, 0)][1] if num_stages > 1 else None
        for sender, receiver in links.values():
            sender.close()
            if receiver is not inbound_link:
                receiver.close()
        logger.info(
            "%d ranks (%s), workers %s%s",
            world_size,
            f"tensor parallel {tensor_size} x pipeline parallel {num_stages}, stages of "
            f"{'/'.join(str(len(stage.layers)) for stage in stages)} layers",
            ", ".join(str(process.pid) for process, _ in workers),
            f", CPUs {[sorted(c) for c in cpus]}" if cpus is not None else "",
        )
        try:
            group = (
                TensorParallelGroup(0, tensor_size, store.port, device, store=store, prefix=f"stage{num_stages - 1}")
                if store is not None
                else None
            )
        except BaseException:
            _stop(workers)
            if inbound_link is not None:
                inbound_link.close()
            raise
        return cls(group, workers, names, extension_channels, stages[-1], inbound_link)

    def share_num_blocks(self, num_blocks: int) -> None:
        """Every worker allocates ``num_blocks`` KV blocks; returns once all have, rank 0
        connected to the stage before it."""
        for _, conn in self._workers:
            conn.send_bytes(messages.encode_words(messages.INIT, num_blocks))
        for name, (_, conn) in zip(self._worker_names, self._workers, strict=True):
            try:
                answer = conn.recv_bytes()
            except EOFError:
                raise RuntimeError(f"{name} exited while starting (its log says why)") from None
            if messages.kind_of(answer) == messages.FAILED:
                raise RuntimeError(f"{name} failed to start: {messages.failure_text(answer)}")
        if self._inbound_link is not None:
            peer = rank_name(replace(self.stage, index=self.stage.index - 1), 0, self._tensor_size)
            self.inbound = ActivationReceiver.connect(self._inbound_link, self._wait_for_stage, peer)

    def send_step(self, batch: FlatBatch) -> None:
        """The step's inputs to every worker, before rank 0's own part of it."""
        message = messages.encode_step(batch)
        for name, (process, conn) in zip(self._worker_names, self._workers, strict=True):
            try:
                conn.send_bytes(message)
            except OSError:
                raise RuntimeError(f"{name} (pid {process.pid}) is gone (exit code {process.exitcode})") from None

    def last_stage_logits(
        self, model: LlamaFamilyForCausalLM, batch: FlatBatch, layer_caches: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Rank 0's part of a step under pipeline parallelism (after :meth:`send_step`): the last
        stage's layers over the stage before's output, then the logits."""
        try:
            logits = run_stage(model, batch, layer_caches, self.inbound, None)
        except StageGone as error:
            self._reap_gone_stages()
            raise RuntimeError(f"pipeline parallel: {self._dead_workers() or error}; the engine stops") from None
        if logits is None:
            raise RuntimeError("bug: the last pipeline stage computed no logits")
        return logits

    def close(self) -> None:
        """Stop every worker (idempotent); kills one that does not exit in time."""
        if not self._closed:
            self._closed = True
            if self.group is not None:
                self.group.close()  # workers waiting in a collective give up on it, and read STOP
            _stop(self._workers)
            for channel in self.extension_channels:
                channel.close()
            if self.inbound is not None:
                self.inbound.close()
            elif self._inbound_link is not None:
                self._inbound_link.close()

    @property
    def _tensor_size(self) -> int:
        return self.group.world_size if self.group is not None else 1

    def _wait_for_stage(self, link: Connection) -> None:
        """Block until the stage before rank 0's has sent (or closed) ``link``; raise at once
        when a worker has died, or after the stage timeout."""
        deadline = time.monotonic() + STAGE_WAIT_TIMEOUT_S
        while not link.poll(_LIVENESS_CHECK_S):
            dead = self._dead_workers()
            if dead:
                raise RuntimeError(f"pipeline parallel: {dead}; the engine stops")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pipeline parallel: the stage before the last sent nothing for {STAGE_WAIT_TIMEOUT_S:.0f} s: "
                    "giving up"
                )

    def _reap_gone_stages(self) -> None:
        """After the stage before rank 0's closed its link: wait (bounded) for it to exit, and
        while a rank exited because the stage before it was gone, for that one too. A rank's
        link closes before the system reports its exit, so without this wait the error could
        name the last rank of a chain, or none, rather than the one that died first."""
        for index in reversed(range(self.stage.index)):
            name = rank_name(replace(self.stage, index=index), 0, self._tensor_size)
            process, _ = self._workers[self._worker_names.index(name)]
            process.join(JOIN_TIMEOUT_S)
            if process.exitcode != STAGE_GONE_EXIT_CODE:
                return

    def _dead_workers(self) -> str:
        """The workers that have exited, named with their exit codes ("" while all live)."""
        return ", ".join(
            f"{name} (pid {process.pid}) died with exit code {process.exitcode}"
            for name, (process, _) in zip(self._worker_names, self._workers, strict=True)
            if not process.is_alive()
        )


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
