"""A worker: the process of one rank other than 0 (engine/tensor_parallel/executor.py). It holds
its shard of its pipeline stage's layers and their KV blocks, and runs every step rank 0 sends
it; only rank 0 samples.

In call order (rank 0's side: engine/tensor_parallel/executor.py):

1. Start (spawned by rank 0): die with the parent, pin to this rank's CPUs, join its stage's
   tensor-parallel group (when the stage has more than one rank).
2. Load this rank's shard of its stage's layers; wait for ``INIT`` (the KV blocks every rank
   allocates), allocate them for its layers, start the worker extension if the config names
   one (engine/tensor_parallel/rank_context.py); name its activation segment to the next stage
   and connect to the previous one's (engine/pipeline_parallel/activation_channel.py); answer
   ``READY``.
3. For each ``STEP``: rebuild the flat batch and run this stage's part of it
   (engine/pipeline_parallel/stage_step.py), whose all-reduces and logits gather meet its
   stage's other ranks and whose activations come from the stage before and go to the next
   (a last stage's logits are then dropped here).
4. ``STOP``, or the pipe closing (rank 0 is gone), also while waiting for the stage before or
   in a collective, or a failed collective or stage link (a peer is gone): exit. Any error is
   reported as ``FAILED`` when the pipe still takes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from engine.attention.backend import select_backend
from engine.config import EngineConfig
from engine.kv_cache_layout import allocate_kv_cache, layer_views
from engine.models import load_model
from engine.pipeline_parallel.activation_channel import ActivationReceiver, ActivationSender, StageGone
from engine.pipeline_parallel.stage_step import run_stage
from engine.pipeline_parallel.stages import PipelineStage
from engine.tensor_parallel import messages
from engine.tensor_parallel.group import TensorParallelGroup
from engine.tensor_parallel.rank_context import RankContext

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# The longest a stage waits for the one before it within a step: that stage's share of the
# step (a long prompt's chunk on a CPU included). It bounds a hang, not normal work.
STAGE_WAIT_TIMEOUT_S = 600.0
# A worker's exit code when a stage link failed: the stage next to it went first. Rank 0 reads
# it to trace a chain of such exits back to the rank that died first, and name that one.
STAGE_GONE_EXIT_CODE = 3


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to start, handed over once at spawn."""

    config: EngineConfig
    model_path: Path
    rank: int  # within its stage's tensor-parallel group
    stage: PipelineStage
    store_port: int  # the stages' groups' store (0: a stage of one rank has none)
    device: str  # torch device name of this rank
    cpus: frozenset[int] | None  # pinned to these; None: left as inherited (a GPU rank)
    log_level: int
    name: str  # as logs and errors name this rank


class EngineStopping(Exception):
    """Rank 0 said stop, or is gone, while this rank waited for something else."""


def rank_name(stage: PipelineStage, rank: int, tensor_parallel_size: int) -> str:
    """How logs and errors name a rank: by its tensor-parallel rank, its pipeline stage, or both."""
    if stage.is_whole:
        return f"tensor-parallel rank {rank}"
    if tensor_parallel_size == 1:
        return f"pipeline stage {stage.index}"
    return f"pipeline stage {stage.index} tensor-parallel rank {rank}"


def main(
    spec: WorkerSpec,
    conn: Connection,
    extension_channel: Connection | None = None,
    inbound: Connection | None = None,
    outbound: Connection | None = None,
) -> None:
    """The worker process's target. ``extension_channel``: the worker extension's, when the
    config names one; ``inbound`` / ``outbound``: the links from the stage before and to the
    stage after (None for the first and the last stage)."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s {spec.name} %(name)s: %(message)s")
    # Die with rank 0 even if it is killed outright: no worker outlives its instance.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(len(spec.cpus))
    try:
        _serve(spec, conn, extension_channel, inbound, outbound)
    except (EOFError, BrokenPipeError, EngineStopping):
        logger.info("rank 0 is gone or stopping: exiting")
    except BaseException as error:
        logger.exception("worker failed")
        with contextlib.suppress(OSError):  # rank 0 may be gone too
            conn.send_bytes(messages.failure(error))
        raise SystemExit(STAGE_GONE_EXIT_CODE if isinstance(error, StageGone) else 1) from None


class RankZeroMessages:
    """What rank 0 sends this worker, read ahead where need be. With batches in flight
    (pipeline parallelism) rank 0 sends the next step while this rank still waits on the
    current one, for the stage before or in a collective: a message from rank 0 then is
    not a stop until it is read and says STOP. Read ahead, it waits here for its turn."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._ahead: deque[bytes] = deque()
        self.stopping = False  # rank 0 said STOP, or is gone

    def next(self) -> bytes:
        """The next message, in order (raises EOFError once rank 0 is gone)."""
        return self._ahead.popleft() if self._ahead else self.conn.recv_bytes()

    def read_ahead(self) -> bool:
        """Take in what has arrived; False once rank 0 has said stop or is gone."""
        while not self.stopping and self.conn.poll():
            try:
                message = self.conn.recv_bytes()
            except (EOFError, OSError):
                self.stopping = True
                break
            self._ahead.append(message)
            self.stopping = messages.kind_of(message) == messages.STOP
        return not self.stopping


def _serve(
    spec: WorkerSpec,
    conn: Connection,
    extension_channel: Connection | None,
    inbound_link: Connection | None,
    outbound_link: Connection | None,
) -> None:
    config, device, stage = spec.config, torch.device(spec.device), spec.stage
    world_size = config.tensor_parallel_size
    rank_zero = RankZeroMessages(conn)

    def wait_readable(link: Connection) -> None:
        """Block until ``link`` has a message (or its end of file), watching rank 0's pipe too."""
        deadline = time.monotonic() + STAGE_WAIT_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            ready = wait([link, conn], timeout=remaining)
            if link in ready:
                return
            if conn in ready and not rank_zero.read_ahead():
                raise EngineStopping
        raise RuntimeError(f"the stage before sent nothing for {STAGE_WAIT_TIMEOUT_S:.0f} s: giving up")

    group = None
    if world_size > 1:
        group = TensorParallelGroup(spec.rank, world_size, spec.store_port, device, prefix=f"stage{stage.index}")
        # A collective waiting in shared memory gives up when rank 0 says stop (or is gone).
        group.watch_peers(rank_zero.read_ahead)
    backend = select_backend(config.attention_backend, device)
    loaded = load_model(
        spec.model_path,
        config.dtype,
        device,
        backend,
        config.max_model_len,
        group,
        config.quantization,
        activations=config.quant_activations,
        stage=stage,
    )
    model, shape = loaded.model, loaded.model.shape
    message = rank_zero.next()
    if messages.kind_of(message) != messages.INIT:
        raise RuntimeError(f"bug: a worker expected INIT, got message kind {messages.kind_of(message)}")
    (num_blocks,) = messages.words_of(message)
    kv_cache = allocate_kv_cache(
        int(num_blocks),
        len(model.layers),
        config.block_size,
        model.local.num_kv_heads,
        shape.head_dim,
        loaded.dtype,
        device,
        config.kv_cache_dtype,
    )
    layer_caches = layer_views(kv_cache, config.kv_cache_dtype)
    if config.worker_extension is not None and extension_channel is not None:
        # A stage of one rank holds every KV head (of its layers).
        kv_heads = model.layout.kv_heads if model.layout is not None else range(shape.num_kv_heads)
        context = RankContext(spec.rank, world_size, kv_cache, kv_heads, extension_channel, stage.index)
        config.worker_extension(context)
    outbound = inbound = None
    try:
        if outbound_link is not None:
            after = PipelineStage(stage.index + 1, stage.num_stages, range(0))
            outbound = ActivationSender.create(
                outbound_link,
                config.max_num_batched_tokens,
                shape.hidden_size,
                loaded.dtype,
                wait_readable,
                rank_name(after, spec.rank, world_size),
            )
        if inbound_link is not None:
            before = PipelineStage(stage.index - 1, stage.num_stages, range(0))
            inbound = ActivationReceiver.connect(inbound_link, wait_readable, rank_name(before, spec.rank, world_size))
        conn.send_bytes(messages.encode_words(messages.READY))
        logger.info(
            "ready: layers %d-%d, %d KV heads, %d KV blocks",
            stage.layers.start,
            stage.layers.stop - 1,
            model.local.num_kv_heads,
            num_blocks,
        )
        while True:
            message = rank_zero.next()
            kind = messages.kind_of(message)
            if kind == messages.STOP:
                return
            if kind != messages.STEP:
                raise RuntimeError(f"bug: a worker got message kind {kind}")
            run_stage(model, messages.decode_step(message, device), layer_caches, inbound, outbound)
    finally:
        for channel in (outbound, inbound):
            if channel is not None:
                channel.close()
