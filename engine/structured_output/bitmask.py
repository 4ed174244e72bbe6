"""Allowed-token bitmasks: computed off the engine's critical path, applied batched.

One step, in call order (``ModelRunner.execute``):

1. Before the forward pass: :meth:`BitmaskWorker.start` hands the grammar states of
   the rows that sample under a grammar to a worker thread, which fills one int32
   bitmask row per state (llguidance, GIL released, rows in parallel on its own pool).
   The states are those of the tokens known before this step; nothing advances them
   until the step's ``update``, so the worker and the engine thread never share a write.
2. The forward pass runs meanwhile.
3. The sampler takes :meth:`PendingBitmask.result` and :func:`apply_token_bitmask` masks
   the rows that need it with one ``masked_fill`` before choosing tokens.

A step with no constrained row starts nothing and pays nothing.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import torch

from engine.structured_output.grammar_state import GrammarState

_BITS = torch.arange(32, dtype=torch.int32)


class PendingBitmask:
    """The bitmask of one step's constrained rows, being computed."""

    __slots__ = ("rows", "_future")

    def __init__(self, rows: list[int], future: Future[torch.Tensor]) -> None:
        self.rows = rows  # logits rows (sampling order) that the bitmask rows describe, in order
        self._future = future

    def result(self) -> torch.Tensor:
        """[len(rows), cdiv(grammar_vocab, 32)] int32; bit t of row i set: token t allowed in rows[i]."""
        return self._future.result()


class BitmaskWorker:
    """One worker thread (the engine asks for one step's mask at a time) and llguidance's pool."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size  # the grammar's vocabulary (the tokenizer's)
        self._words = (vocab_size + 31) // 32
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        self._executor = llguidance.LLExecutor(num_threads)

    def start(self, rows: list[int], states: list[GrammarState]) -> PendingBitmask:
        return PendingBitmask(rows, self._thread.submit(self._fill, states))

    def _fill(self, states: list[GrammarState]) -> torch.Tensor:
        bitmask = np.zeros((len(states), self._words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask)
        return torch.from_numpy(bitmask)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every token of ``rows`` the bitmask does not allow.

    ``logits``: [num_rows, vocab] float32; ``bitmask``: [len(rows), words] int32 from
    :class:`BitmaskWorker`. Model ids beyond the grammar's vocabulary (padding rows of
    the embedding) are never allowed; a grammar vocabulary wider than the model's is cut.
    """
    vocab_size = logits.shape[1]
    # [R, words, 32] -> [R, words * 32]: bit b of word w is token 32 * w + b
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab_size]
    index = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
