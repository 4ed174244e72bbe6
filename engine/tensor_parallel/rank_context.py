"""What a worker extension gets in each tensor-parallel worker process.

An instance may run code of its own beside the engine in every rank's process (vLLM's worker
extension): the decode and prefill services run a KV connector per rank there, so that each
rank moves its own KV (its heads of its stage's layers) rank to rank.
``EngineConfig.worker_extension`` names the function; each worker (every rank but rank 0, of
every pipeline stage) calls it once its KV cache exists, before it answers ready. The function
must return at once: it starts a thread of its own for its work, and talks to its counterpart
in rank 0's process over ``channel`` (raw bytes, its own format).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch


@dataclass(frozen=True, slots=True)
class RankContext:
    rank: int
    world_size: int
    kv_cache: torch.Tensor  # this rank's, block-major (engine/kv_cache_layout.py), its KV heads only
    kv_heads: range  # the model's KV heads that cache holds
    channel: Connection  # to the extension's side in rank 0's process
    pipeline_stage: int = 0  # the stage whose layers the cache holds (engine/pipeline_parallel/stages.py)


WorkerExtension = Callable[[RankContext], None]
