"""Logits of given tokens through the engine's own forward path, with no scheduler and no
sampler: what the quality measurements feed on (engine/perplexity.py, and the KV-dtype
agreement of microbench/kv_cache_dtype.py).

The tokens go through the loaded model exactly as a step's do: a flat batch
(engine/flat_batch.py) over block tables of the engine's paged KV cache, so the weights as
loaded (dequantized, GGUF blocks kept quantized, int8) and the KV cache's dtype (its 8-bit
rows written and read back, engine/kv_cache_dtype.py) shape the logits as they shape served
tokens. The blocks are borrowed from the engine's own pool for the duration and given back
after, so the pool's counts are what they were; hence an idle engine only (the scheduler
would otherwise hand the same blocks out).

These calls run the model's modules (``runner.model``), the path every prefill takes. CPU
decode steps in serving take the native one-call step where the model allows
(engine/models/native_decode.py); the teacher-forced decode steps below do not. Tensor
parallelism is not driven here: its workers step only with the runner.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from engine.engine_core import EngineCore
from engine.flat_batch import build_flat_batch
from engine.kv_cache_utils import cdiv


@contextmanager
def borrowed_block_rows(engine: EngineCore, num_rows: int, num_tokens: int) -> Iterator[list[list[int]]]:
    """``num_rows`` rows of blocks, each enough for ``num_tokens`` tokens, taken from the engine's
    pool (evicting cached blocks as any allocation does) and freed on leaving."""
    if engine.config.world_size > 1:
        raise ValueError("teacher-forced logits run in one process; use tensor and pipeline parallel size 1")
    if engine.has_unfinished_requests():
        raise ValueError("teacher-forced logits need an idle engine: its requests hold blocks the pool would reuse")
    pool = engine.kv_cache_manager.block_pool
    blocks_each = cdiv(num_tokens, engine.runner.block_size)
    if blocks_each * num_rows > pool.num_free_blocks:
        raise ValueError(
            f"{num_rows} sequences of {num_tokens} tokens need {blocks_each * num_rows} KV blocks, the engine has "
            f"{pool.num_free_blocks} free; raise kv_cache_memory"
        )
    blocks = pool.get_new_blocks(blocks_each * num_rows)
    try:
        yield [[block.block_id for block in blocks[i * blocks_each : (i + 1) * blocks_each]] for i in range(num_rows)]
    finally:
        pool.free_blocks(reversed(blocks))


@torch.inference_mode()
def forward(
    engine: EngineCore,
    input_ids: list[int],
    num_new: Sequence[int],
    num_computed: Sequence[int],
    block_rows: Sequence[list[int]],
    num_decodes: int = 0,
    logits_indices: np.ndarray | None = None,
    final_hidden_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward pass over rows of ``num_new[i]`` tokens (of ``input_ids``, laid end to end)
    after ``num_computed[i]`` already in row i's blocks; the first ``num_decodes`` rows hold
    one token each. Returns float32 logits [R, vocab] of the batch's rows ``logits_indices``
    (positions in ``input_ids``), by default of each row's last token; their final hidden
    states [R, hidden_size] into ``final_hidden_out`` if given (Medusa heads' training data)."""
    runner = engine.runner
    batch = build_flat_batch(
        input_ids,
        np.asarray(num_new, dtype=np.int64),
        np.asarray(num_computed, dtype=np.int64),
        block_rows,
        np.ones(len(num_new), dtype=bool),
        num_decodes,
        runner.block_size,
        runner.to_device,
    )
    if logits_indices is not None:
        batch.logits_indices = runner.to_device(logits_indices.astype(np.int64))
    return runner.model(
        batch.input_ids, batch.positions, runner.layer_caches, batch.metadata, batch.logits_indices, final_hidden_out
    )


def teacher_forced_logits(
    engine: EngineCore, prompts: list[list[int]], continuations: list[list[int]]
) -> Iterator[torch.Tensor]:
    """The engine's next-token logits [num_prompts, vocab] at each position of the continuations
    (all of one length), every prompt's reference tokens fed in (position 0: after the prompt):
    the prompts in one prefill, then one batched decode step per position. The blocks are held
    until the iterator ends or is closed."""
    lengths = [len(p) for p in prompts]
    with borrowed_block_rows(engine, len(prompts), max(lengths) + len(continuations[0])) as block_rows:
        yield forward(engine, [t for p in prompts for t in p], lengths, [0] * len(prompts), block_rows)
        for step in range(len(continuations[0]) - 1):
            tokens = [c[step] for c in continuations]
            num_computed = [n + step for n in lengths]
            yield forward(engine, tokens, [1] * len(prompts), num_computed, block_rows, num_decodes=len(prompts))
