"""Perplexity of a model as the engine serves it, by llama.cpp's ``llama-perplexity`` method, so
that the figures of the two compare on the same text.

The method (llama.cpp's ``examples/perplexity``, its default mode):

1. The whole text is tokenized once, with a BOS token first where the model's tokenizer adds one.
2. It is cut into ``n = len // ctx_size`` non-overlapping chunks of ``ctx_size`` tokens (the
   rest is dropped); at least two are needed. Each chunk is evaluated alone, from position 0,
   its first token replaced by BOS where the tokenizer adds one.
3. In each chunk the first half is context only: the logits at positions ``ctx/2 .. ctx-2``
   score the tokens at ``ctx/2 + 1 .. ctx-1`` (``ctx - 1 - ctx/2`` tokens a chunk).
4. The perplexity is ``exp`` of the mean negative log-likelihood over every scored token, with
   a running figure after each chunk; its standard error is llama.cpp's estimate,
   ``ppl * sqrt(var(nll) / (count - 1))``.

The logits come from the engine's own forward path (engine/teacher_forcing.py): the weights as
loaded, attention over the paged KV cache in its dtype. Several chunks share a forward pass
(``batch_size // ctx_size`` of them, as llama.cpp batches ``n_batch / n_ctx`` sequences); a
chunk longer than ``batch_size`` goes in pieces, each attending to the pieces before it through
the cache (the engine's chunked prefill).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from engine.config import DTypeName
from engine.default_model import LoadFormat
from engine.engine_core import EngineCore, resolve_model_path
from engine.gguf_files import metadata_folder
from engine.kv_cache_utils import cdiv
from engine.llm import LLM
from engine.models.loader import model_max_len
from engine.teacher_forcing import borrowed_block_rows, forward

BLOCK_SIZE = 16  # the engine's default block size (any works: the chunks' blocks are borrowed whole)


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How the chunks are cut and run: ``ctx_size`` tokens a chunk, at most ``batch_size``
    tokens a forward pass, at most ``max_chunks`` chunks (None: all the text holds)."""

    ctx_size: int = 512
    batch_size: int = 2048
    max_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.ctx_size < 3:
            raise ValueError(
                f"--ctx-size must be at least 3 (a context half and a token to score), got {self.ctx_size}"
            )
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.max_chunks is not None and self.max_chunks < 2:
            raise ValueError(f"--chunks must be at least 2 (a standard error needs them), got {self.max_chunks}")

    @property
    def first_scored(self) -> int:
        """The position whose logits score the first scored token (the token after it)."""
        return self.ctx_size // 2

    @property
    def num_scored_per_chunk(self) -> int:
        return self.ctx_size - 1 - self.first_scored

    @property
    def chunks_per_forward(self) -> int:
        return max(1, self.batch_size // self.ctx_size)

    @property
    def piece_len(self) -> int:
        """Tokens of each chunk in one forward pass: the whole chunk, or a piece of it."""
        return min(self.ctx_size, self.batch_size)


@dataclass(slots=True)
class NLLTotals:
    """Sums over scored tokens of the negative log-likelihood and its square, in float64."""

    nll: float = 0.0
    nll_squared: float = 0.0
    count: int = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """logits: [n, vocab] (float32), the rows predicting ``targets`` [n]."""
        nll = -torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1).double()
        self.nll += float(nll.sum())
        self.nll_squared += float((nll * nll).sum())
        self.count += len(targets)

    def merge(self, other: NLLTotals) -> None:
        self.nll += other.nll
        self.nll_squared += other.nll_squared
        self.count += other.count

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def standard_error(self) -> float:
        """llama-perplexity's estimate of the perplexity's standard error (0 for a single token)."""
        mean = self.nll / self.count
        variance = self.nll_squared / self.count - mean * mean
        if self.count < 2 or variance <= 0:
            return 0.0
        return self.perplexity * math.sqrt(variance / (self.count - 1))


@dataclass(slots=True)
class PerplexityResult:
    ctx_size: int
    batch_size: int
    num_text_tokens: int
    bos_token_id: int | None  # the BOS each chunk starts with; None: the tokenizer adds none
    num_chunks: int
    num_scored: int
    perplexity: float
    standard_error: float
    mean_nll: float
    running_perplexity: list[float] = field(default_factory=list)  # after each chunk
    seconds: float = 0.0  # the forward passes and scoring, not the load nor the tokenizing


def tokenize_text(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], int | None]:
    """The text's token ids, BOS first where the tokenizer adds one (llama.cpp's add_bos), and
    that BOS id (None where it adds none)."""
    bos = tokenizer.bos_token_id
    with_special, plain = tokenizer("x")["input_ids"], tokenizer("x", add_special_tokens=False)["input_ids"]
    adds_bos = bos is not None and with_special[:1] == [bos] and plain[:1] != [bos]
    token_ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return ([bos, *token_ids], bos) if adds_bos else (list(token_ids), None)


def split_chunks(token_ids: list[int], plan: ChunkPlan, bos_token_id: int | None) -> list[list[int]]:
    """The text's non-overlapping chunks of ``plan.ctx_size`` tokens, each starting with BOS
    (in place of its first token) when ``bos_token_id`` is given."""
    ctx = plan.ctx_size
    if len(token_ids) < 2 * ctx:
        raise ValueError(
            f"the text has {len(token_ids)} tokens; chunks of --ctx-size {ctx} need at least {2 * ctx} "
            "(two chunks, as llama-perplexity asks): give a longer --text-file or a smaller --ctx-size"
        )
    num_chunks = len(token_ids) // ctx
    if plan.max_chunks is not None:
        num_chunks = min(num_chunks, plan.max_chunks)
    chunks = [token_ids[i * ctx : (i + 1) * ctx] for i in range(num_chunks)]
    if bos_token_id is not None:
        for chunk in chunks:
            chunk[0] = bos_token_id
    return chunks


def open_engine(
    model: str | None,
    plan: ChunkPlan,
    load_format: LoadFormat = "auto",
    dtype: DTypeName = "auto",
    device: str = "auto",
    **config: object,
) -> LLM:
    """An engine for :func:`measure`: a KV cache of just the blocks one forward pass holds, no
    prefix cache (each chunk is computed, never reused). ``model``, ``load_format``, ``dtype``
    and ``device`` as :class:`~engine.config.EngineConfig` takes them; ``config``: the rest of
    the numerics (quantization, quant_activations, kv_cache_dtype)."""
    path = resolve_model_path(model, load_format, dtype, device)
    hf_config = AutoConfig.from_pretrained(str(metadata_folder(path)))
    supported = model_max_len(hf_config)
    if plan.ctx_size > supported:
        raise ValueError(
            f"--ctx-size {plan.ctx_size} exceeds the model's context ({supported} tokens); pass a smaller --ctx-size"
        )
    return LLM(
        str(path),
        dtype=dtype,
        device=device,
        max_model_len=plan.ctx_size,
        block_size=BLOCK_SIZE,
        num_blocks_override=plan.chunks_per_forward * cdiv(plan.ctx_size, BLOCK_SIZE),
        enable_prefix_caching=False,
        **config,
    )


def chunk_totals(engine: EngineCore, chunks: list[list[int]], plan: ChunkPlan) -> Iterator[NLLTotals]:
    """Each chunk's scored-token totals, in order, computed ``plan.chunks_per_forward`` chunks
    to a forward pass (in pieces of ``plan.piece_len`` tokens when a chunk exceeds the batch)."""
    ctx, first, piece = plan.ctx_size, plan.first_scored, plan.piece_len
    rows = plan.chunks_per_forward
    for group_start in range(0, len(chunks), rows):
        group = chunks[group_start : group_start + rows]
        totals = [NLLTotals() for _ in group]
        with borrowed_block_rows(engine, len(group), ctx) as block_rows:
            for start in range(0, ctx, piece):
                end = min(start + piece, ctx)
                # The positions of this piece whose logits score a token: [first, ctx - 1).
                scored = np.arange(max(start, first), min(end, ctx - 1), dtype=np.int64)
                offsets = np.concatenate([row * (end - start) + scored - start for row in range(len(group))])
                logits = forward(
                    engine,
                    [token for chunk in group for token in chunk[start:end]],
                    [end - start] * len(group),
                    [start] * len(group),
                    block_rows,
                    logits_indices=offsets if len(scored) else None,  # None: a piece of context only
                )
                if not len(scored):
                    continue
                for row, chunk in enumerate(group):
                    targets = torch.tensor([chunk[p + 1] for p in scored], device=logits.device)
                    totals[row].add(logits[row * len(scored) : (row + 1) * len(scored)], targets)
        yield from totals


def measure(
    llm: LLM, text: str, plan: ChunkPlan, on_chunk: Callable[[int, float], None] | None = None
) -> PerplexityResult:
    """The perplexity of ``llm`` over ``text``; ``on_chunk(index, running_perplexity)`` after each
    chunk (from 1). Raises ValueError when the text holds fewer than two chunks."""
    if plan.ctx_size > llm.engine.max_model_len:
        raise ValueError(
            f"--ctx-size {plan.ctx_size} exceeds the engine's max_model_len ({llm.engine.max_model_len}); "
            "open it with open_engine() for this plan"
        )
    token_ids, bos = tokenize_text(llm.tokenizer, text)
    chunks = split_chunks(token_ids, plan, bos)
    total = NLLTotals()
    running: list[float] = []
    started = time.perf_counter()
    for index, totals in enumerate(chunk_totals(llm.engine, chunks, plan), 1):
        total.merge(totals)
        running.append(total.perplexity)
        if on_chunk is not None:
            on_chunk(index, total.perplexity)
    return PerplexityResult(
        ctx_size=plan.ctx_size,
        batch_size=plan.batch_size,
        num_text_tokens=len(token_ids),
        bos_token_id=bos,
        num_chunks=len(chunks),
        num_scored=total.count,
        perplexity=total.perplexity,
        standard_error=total.standard_error,
        mean_nll=total.nll / total.count,
        running_perplexity=running,
        seconds=time.perf_counter() - started,
    )
