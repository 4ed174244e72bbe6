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
        """[len(rows), model vocab] float32 on the CPU: 0 where a token is allowed, -inf where
        forbidden. A view of the worker's buffer: valid until the worker's next ``start``."""
        return self._future.result()


# Byte value -> its 8 tokens' biases, lowest bit first (bit set: allowed, 0; clear: -inf).
_BIAS_OF_BYTE = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)


class BitmaskWorker:
    """One worker thread (the engine asks for one step's masks at a time) and llguidance's pool.

    The worker also turns llguidance's bits into an additive bias (one float per token),
    so the sampler's share of the work is one batched add. Its buffers are reused from
    step to step: a step's bias is consumed by that step's sampler before the next
    step starts the worker again (allocating 6 MB a step cost more in page faults than
    the unpacking itself: docs/benchmarks.md, "Structured outputs: what a JSON schema costs").
    """

    def __init__(self, grammar_vocab_size: int, model_vocab_size: int, num_threads: int | None = None) -> None:
        self.grammar_vocab_size = grammar_vocab_size  # the tokenizer's: one bit each
        self.model_vocab_size = model_vocab_size  # the logits' width
        self._words = (grammar_vocab_size + 31) // 32
        self._bitmask = np.zeros((0, self._words), dtype=np.int32)
        self._bias = np.zeros((0, self._words * 32), dtype=np.float32)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        self._executor = llguidance.LLExecutor(num_threads)

    def start(self, rows: list[int], states: list[GrammarState]) -> PendingBitmask:
        return PendingBitmask(rows, self._thread.submit(self._fill, states))

    def _fill(self, states: list[GrammarState]) -> torch.Tensor:
        num_rows = len(states)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = np.zeros((num_rows, self._words), dtype=np.int32)
            self._bias = np.zeros((num_rows, self._words * 32), dtype=np.float32)
        bitmask = self._bitmask[:num_rows]
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask
        )
        return token_bias(bitmask, self.model_vocab_size, out=self._bias[:num_rows])

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def token_bias(bitmask: np.ndarray, vocab_size: int, out: np.ndarray | None = None) -> torch.Tensor:
    """llguidance's bitmask ([R, words] int32, bit b of word w: token 32 * w + b allowed) as
    an additive bias [R, vocab_size] float32: 0 where allowed, -inf where forbidden.
    ``out`` ([R, 32 * words] float32, C-contiguous) receives the unpacked bits; the result may be
    a view of it."""
    num_rows, num_words = bitmask.shape
    if out is None:
        out = np.empty((num_rows, num_words * 32), dtype=np.float32)
    # Little-endian words: byte k of a row holds tokens 8k..8k+7, lowest bit first.
    packed = np.ascontiguousarray(bitmask).view(np.uint8)
    np.take(_BIAS_OF_BYTE, packed, axis=0, out=out.reshape(num_rows, num_words * 4, 8))
    return fit_to_vocab(torch.from_numpy(out), vocab_size)


def fit_to_vocab(bias: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Model ids beyond the grammar's vocabulary (an embedding padded past the tokenizer) are
    forbidden; a grammar vocabulary wider than the model's is cut to it."""
    if bias.shape[1] >= vocab_size:
        return bias[:, :vocab_size]
    return torch.nn.functional.pad(bias, (0, vocab_size - bias.shape[1]), value=float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bias: torch.Tensor) -> None:
    """Set to -inf, in place, the tokens of ``rows`` that their grammar forbids.

    ``logits``: [num_rows, vocab] float32; ``bias``: [len(rows), vocab] from
    :class:`BitmaskWorker` (0 or -inf). One batched add over the rows that need it: on
    CPU an add costs a small fraction of a ``masked_fill_`` with a bool mask of the same
    shape (docs/benchmarks.md, "Structured outputs: what a JSON schema costs").
    """
    bias = bias.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # rows are ascending and distinct: all of them, in order
        logits.add_(bias)
        return
    logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
