"""A tensor-parallel worker: the process of one rank other than 0. It holds its shard of the
model and its heads' KV blocks, and runs every step rank 0 sends it; only rank 0 samples.

In call order (rank 0's side: engine/tensor_parallel/executor.py):

1. Start (spawned by rank 0): die with the parent, pin to this rank's CPUs, join the group.
2. Load this rank's shard of the checkpoint; wait for ``INIT`` (the KV blocks every rank
   allocates), allocate them, start the worker extension if the config names one
   (engine/tensor_parallel/rank_context.py), answer ``READY``.
3. For each ``STEP``: rebuild the flat batch and run the forward pass, whose all-reduces and
   logits gather meet rank 0's and the other workers' (the logits are then dropped here).
4. ``STOP``, or the pipe closing (rank 0 is gone), or a failed collective (a peer is gone):
   exit. Any error is reported as ``FAILED`` when the pipe still takes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.attention.backend import select_backend
from engine.config import EngineConfig
from engine.kv_cache_layout import allocate_kv_cache, layer_views
from engine.models import load_model
from engine.tensor_parallel import messages
from engine.tensor_parallel.group import TensorParallelGroup
from engine.tensor_parallel.rank_context import RankContext

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to start, handed over once at spawn."""

    config: EngineConfig
    model_path: Path
    rank: int
    store_port: int
    device: str  # torch device name of this rank
    cpus: frozenset[int] | None  # pinned to these; None: left as inherited (a GPU rank)
    log_level: int


def main(spec: WorkerSpec, conn: Connection, extension_channel: Connection | None = None) -> None:
    """The worker process's target. ``extension_channel``: the worker extension's, when the
    config names one."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s")
    # Die with rank 0 even if it is killed outright: no worker outlives its instance.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(len(spec.cpus))
    try:
        _serve(spec, conn, extension_channel)
    except (EOFError, BrokenPipeError):
        logger.info("rank 0 is gone: exiting")
    except BaseException as error:
        logger.exception("tensor-parallel worker failed")
        with contextlib.suppress(OSError):  # rank 0 may be gone too
            conn.send_bytes(messages.failure(error))
        raise SystemExit(1) from None


def _serve(spec: WorkerSpec, conn: Connection, extension_channel: Connection | None) -> None:
    config, device = spec.config, torch.device(spec.device)
    world_size = config.tensor_parallel_size
    group = TensorParallelGroup(spec.rank, world_size, spec.store_port, device)
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
    )
    model, shape = loaded.model, loaded.model.shape
    message = conn.recv_bytes()
    if messages.kind_of(message) != messages.INIT:
        raise RuntimeError(f"bug: a tensor-parallel worker expected INIT, got message kind {messages.kind_of(message)}")
    (num_blocks,) = messages.words_of(message)
    kv_cache = allocate_kv_cache(
        int(num_blocks),
        shape.num_layers,
        config.block_size,
        model.local.num_kv_heads,
        shape.head_dim,
        loaded.dtype,
        device,
        config.kv_cache_dtype,
    )
    layer_caches = layer_views(kv_cache, config.kv_cache_dtype)
    if config.worker_extension is not None and extension_channel is not None and model.layout is not None:
        config.worker_extension(RankContext(spec.rank, world_size, kv_cache, model.layout.kv_heads, extension_channel))
    conn.send_bytes(messages.encode_words(messages.READY))
    logger.info(
        "rank %d of %d ready: %d KV heads, %d KV blocks", spec.rank, world_size, model.local.num_kv_heads, num_blocks
    )
    while True:
        message = conn.recv_bytes()
        kind = messages.kind_of(message)
        if kind == messages.STOP:
            return
        if kind != messages.STEP:
            raise RuntimeError(f"bug: a tensor-parallel worker got message kind {kind}")
        batch = messages.decode_step(message, device)
        model(batch.input_ids, batch.positions, layer_caches, batch.metadata, batch.logits_indices)
