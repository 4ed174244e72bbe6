"""Allowed-token bitmasks: computed off the engine's critical path, applied batched.

One step, in call order (``ModelRunner.execute``):

1. Before the forward pass: :meth:`BitmaskWorker.start` hands the grammar states of
   the rows that sample under a grammar to a worker thread, which fills one int32
   bitmask row per state (llguidance, GIL released, rows in parallel on its own pool).
   The states are those of the tokens known before this step; nothing advances them
   until the step's ``update``, so the worker and the engine thread never share a write.
2. The forward pass runs meanwhile.
   The worker also unpacks the bits into an additive bias (0 allowed, -inf forbidden),
   off the critical path too.
3. The sampler takes :meth:`PendingBitmask.result` and :func:`apply_token_bitmask` masks
   the rows that need it with one batched add before choosing tokens.

A step with no constrained row starts nothing and pays nothing.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import torch

from engine.structured_output.grammar_state import GrammarState

class PendingBitmask:
    """The token masks of one step's constrained rows, being computed."""

    __slots__ = ("rows", "_future")

    def __init__(self, rows: list[int], future: Future[torch.Tensor]) -> None:
        self.rows = rows  # logits rows (sampling order) that the mask rows describe, in order
        self._future = future

    def result(self) -> torch.Tensor:
        """[len(rows), model vocab] float32 on the CPU: 0 where a token is allowed, -inf where forbidden."""
        return self._future.result()


class BitmaskWorker:
    """One worker thread (the engine asks for one step's masks at a time) and llguidance's pool.

    The worker also unpacks llguidance's bits into an additive bias (0 or -inf per token),
    so the sampler's share of the work is one batched add.
    """

    def __init__(self, grammar_vocab_size: int, model_vocab_size: int, num_threads: int | None = None) -> None:
        self.grammar_vocab_size = grammar_vocab_size  # the tokenizer's: one bit each
        self.model_vocab_size = model_vocab_size  # the logits' width
        self._words = (grammar_vocab_size + 31) // 32
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        self._executor = llguidance.LLExecutor(num_threads)

    def start(self, rows: list[int], states: list[GrammarState]) -> PendingBitmask:
        return PendingBitmask(rows, self._thread.submit(self._fill, states))

    def _fill(self, states: list[GrammarState]) -> torch.Tensor:
        bitmask = np.zeros((len(states), self._words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask)
        return token_bias(bitmask, self.model_vocab_size)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


_BIAS_OF_BIT = np.array([-np.inf, 0.0], dtype=np.float32)  # bit 0: forbidden, bit 1: allowed


def token_bias(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask ([R, words] int32, bit b of word w: token 32 * w + b allowed) as
    an additive bias [R, vocab_size] float32: 0 where allowed, -inf where forbidden. Model ids
    beyond the grammar's vocabulary (an embedding padded past the tokenizer) are forbidden;
    a wider grammar vocabulary is cut to the model's."""
    # Little-endian words: byte k of a row holds tokens 8k..8k+7, lowest bit first.
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=min(vocab_size, bitmask.shape[1] * 32), bitorder="little")
    bias = np.full((bitmask.shape[0], vocab_size), -np.inf, dtype=np.float32)
    np.take(_BIAS_OF_BIT, bits, out=bias[:, : bits.shape[1]])
    return torch.from_numpy(bias)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bias: torch.Tensor) -> None:
    """Set to -inf, in place, the tokens of ``rows`` that their grammar forbids.

    ``logits``: [num_rows, vocab] float32; ``bias``: [len(rows), vocab] from
    :class:`BitmaskWorker` (0 or -inf). One batched add over the rows that need it: on
    CPU an add runs some 30x faster than a ``masked_fill_`` with a bool mask of the same
    shape (0.2 against 7 ms for 32 rows of SmolLM2's 49152 tokens, one thread, measured).
    """
    bias = bias.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # rows are ascending and distinct: all of them, in order
        logits.add_(bias)
        return
    logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
