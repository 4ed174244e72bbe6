"""Turn one step's logits into next tokens (and, when asked, their logprobs).

Semantics follow vLLM v1 and the OpenAI API: penalties, then min_tokens
masking, then the grammar's mask (structured outputs; the bias comes ready from
``engine.structured_output.bitmask``), then greedy argmax or temperature / top-k /
top-p / min-p sampling;
logprobs describe the model's raw distribution, before any of that processing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output.bitmask import apply_token_bitmask


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs reported for one sampled token, under the raw model distribution."""

    token_id: int
    logprob: float  # of the sampled token
    rank: int  # 1 = most likely under the raw distribution; ties share the worst rank, as in vLLM
    top_logprobs: list[tuple[int, float]]  # top-N (token_id, logprob), N = params.logprobs, most likely first


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row inputs of one sampling step; row i of every list describes logits row i."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far, before this step
    generators: list[torch.Generator | None]  # a seeded generator owned by the request; None: the sampler's own
    eos_token_ids: frozenset[int]  # min_tokens masks these as well as params.stop_token_ids
    # Rows that sample under a grammar (ascending), and their grammar's additive bias:
    # [len(grammar_rows), vocab] float32, 0 where a token is allowed, -inf where forbidden.
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bias: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    """One step's result, row for row."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None


class Sampler:
    """Picks the next token of every row that samples this step.

    Owns one ``torch.Generator`` (seeded with ``seed``) used for every row without
    a generator of its own; seeded requests bring theirs in ``SamplingMetadata``
    so their tokens do not depend on what else shares the batch.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Called by the model runner once per engine step.

        ``logits``: [num_rows, vocab], any float dtype, on this sampler's device;
        it is not modified. Returns one token id per row, plus logprobs for rows
        that asked for them.
        """
        num_rows = logits.shape[0]
        if not (
            len(metadata.params)
            == len(metadata.prompt_token_ids)
            == len(metadata.output_token_ids)
            == len(metadata.generators)
            == num_rows
        ):
            raise RuntimeError(f"bug: SamplingMetadata lists must have one entry per logits row ({num_rows} rows)")
        # The throughput benchmark's hot loop: plain greedy decoding needs no copy,
        # no float32 upcast (argmax is exact in any dtype) and one device sync.
        if not _needs_processing(metadata):
            return SamplerOutput(token_ids=logits.argmax(-1).tolist(), logprobs=[None] * num_rows)

        params = metadata.params
        # A private float32 copy: processing is in place and the caller's tensor stays intact.
        logits = logits.to(torch.float32, copy=True)  # [num_rows, vocab]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs describe the raw model distribution (vLLM's default), so take them first.
        raw_logprobs = logits[logprob_rows].log_softmax(-1) if logprob_rows else None

        apply_penalties(logits, params, metadata.prompt_token_ids, metadata.output_token_ids)
        apply_min_tokens(logits, params, metadata.output_token_ids, metadata.eos_token_ids)
        if metadata.grammar_bias is not None:
            apply_token_bitmask(logits, metadata.grammar_rows, metadata.grammar_bias)

        token_ids = logits.argmax(-1)  # [num_rows]; final for greedy rows
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            sampled = self._sample(
                logits[random_rows],
                [params[i] for i in random_rows],
                [metadata.generators[i] for i in random_rows],
            )
            token_ids[random_rows] = sampled

        token_id_list = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            entries = _gather_logprobs(raw_logprobs, token_ids[logprob_rows], params, logprob_rows)
            for i, entry in zip(logprob_rows, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_id_list, logprobs=logprobs)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Draw one token per row from temperature / top-k / top-p / min-p processed logits.

        ``logits``: [num_random, vocab] float32, owned (modified in place). Returns [num_random] int64.
        """
        probs = processed_probs(logits, params)
        return self.race(probs, generators)

    def race(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of ``probs`` ([R, vocab], non-negative, rows need not sum to 1;
        overwritten), drawn with each row's generator or, for None, this sampler's own."""
        # Exponential race: argmax(p / q), q ~ Exp(1), samples from p, and lets each
        # seeded row draw its q from its own generator, independent of the batch.
        q = torch.empty_like(probs)
        if any(g is None for g in generators):
            q.exponential_(generator=self.generator)  # one call covers every unseeded row
        for row, generator in enumerate(generators):
            if generator is None:
                continue
            if generator.device == q.device:
                q[row].exponential_(generator=generator)
            else:
                # Requests may own a CPU generator while sampling runs on the GPU: draw where
                # the generator lives, so a seed gives the same tokens on either device.
                draw = torch.empty(q.shape[1], dtype=torch.float32, device=generator.device)
                q[row].copy_(draw.exponential_(generator=generator))
        # A zero draw would make 0 / 0 = nan for a masked token, and argmax prefers nan.
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return probs.div_(q).argmax(-1)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to ``logits`` ([R, vocab] float32, owned:
    modified in place), one row per entry of ``params``; returns [R, vocab] probabilities,
    rows summing to 1 except that min-p zeroes its tokens without renormalizing."""
    device = logits.device
    vocab_size = logits.shape[1]
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    logits.div_(temperatures.unsqueeze(1))

    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(
            logits,
            # A disabled top-k keeps the whole vocabulary.
            torch.tensor([k if k > 0 else vocab_size for k in top_k], device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device),
        )
    elif any(top_k):
        # Without top-p no full sort is needed; a partial top-k is far cheaper.
        _apply_top_k(logits, top_k)

    probs = logits.softmax(-1)  # [num_random, vocab]
    min_p = [p.min_p for p in params]
    if any(min_p):
        # min_p compares ratios to the top probability, so it needs no renormalizing,
        # and neither does the exponential race.
        min_p_t = torch.tensor(min_p, dtype=torch.float32, device=device).unsqueeze(1)
        probs.masked_fill_(probs < probs.amax(-1, keepdim=True) * min_p_t, 0.0)
    return probs


def _needs_processing(metadata: SamplingMetadata) -> bool:
    """False when every row is plain greedy: argmax of the raw logits is the whole answer."""
    if metadata.grammar_rows:
        return True
    for p, output in zip(metadata.params, metadata.output_token_ids):
        if not p.is_greedy or p.logprobs is not None or p.uses_penalties or len(output) < p.min_tokens:
            return True
    return False


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> None:
    """Apply repetition, then frequency and presence penalties, in place, to rows that use them.

    ``logits``: [num_rows, vocab] float32. Repetition penalty covers tokens seen in
    the prompt or the output (positive logits divided by it, negative multiplied);
    frequency / presence penalties count output tokens only, as in the OpenAI API.
    """
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return
    device = logits.device
    vocab_size = logits.shape[1]
    sub = logits[rows]  # [num_penalized, vocab], a copy
    output_counts = _token_counts([output_token_ids[i] for i in rows], vocab_size, device)

    repetition = [params[i].repetition_penalty for i in rows]
    # Prompts can be long; only scatter them when some row needs them.
    if any(r != 1.0 for r in repetition):
        seen = (_token_counts([prompt_token_ids[i] for i in rows], vocab_size, device) > 0) | (output_counts > 0)
        penalty = torch.tensor(repetition, dtype=torch.float32, device=device).unsqueeze(1)
        penalty = torch.where(seen, penalty, 1.0)
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)

    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=torch.float32, device=device)
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=torch.float32, device=device)
    sub -= frequency.unsqueeze(1) * output_counts + presence.unsqueeze(1) * (output_counts > 0)
    logits[rows] = sub


def apply_min_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: frozenset[int],
) -> None:
    """Forbid EOS and stop token ids, in place, in rows that have not yet produced min_tokens.

    EOS is masked even with ``ignore_eos``, as vLLM does (its all_stop_token_ids
    keeps the model's EOS). Ids beyond the vocabulary can never be sampled and are skipped.
    """
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, output) in enumerate(zip(params, output_token_ids)):
        if len(output) < p.min_tokens:
            for token_id in eos_token_ids.union(p.stop_token_ids):
                if token_id < vocab_size:
                    rows.append(i)
                    cols.append(token_id)
    if rows:
        logits[rows, cols] = float("-inf")


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """Mask to -inf, in place, every logit below its row's k-th largest (0: row keeps all).

    ``logits``: [R, vocab]; ``top_k``: one entry per row. Ties with the k-th value
    survive, as in vLLM and ``_apply_top_k_top_p``.
    """
    vocab_size = logits.shape[1]
    ks = [min(k, vocab_size) for k in top_k]
    top_values = logits.topk(max(ks), dim=-1).values  # [R, max_k], largest first
    # Disabled rows gather any column, then compare against -inf, which drops nothing.
    kth_index = torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device).unsqueeze(1)
    kth_largest = top_values.gather(1, kth_index)
    disabled = torch.tensor([k == 0 for k in ks], device=logits.device).unsqueeze(1)
    kth_largest.masked_fill_(disabled, float("-inf"))
    logits.masked_fill_(logits < kth_largest, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p on the top-k survivors, drop; returns a new tensor.

    ``logits``: [R, vocab]; ``top_k``: [R] in 1..vocab (vocab: disabled) or more;
    ``top_p``: [R] in (0, 1] (1: disabled). Top-p keeps the smallest set whose
    cumulative probability reaches top_p, and always the most likely token.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending: the dropped tail comes first
    kth_index = (vocab_size - top_k).clamp_min(0).unsqueeze(1)
    kth_largest = sorted_logits.gather(1, kth_index)
    # Ties with the k-th value survive, as in vLLM.
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))

    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # Drop a token when it and everything less likely hold at most 1 - top_p.
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_ids), vocab_size] float32: how often each token occurs in each list."""
    max_len = max(map(len, token_ids))
    # Pad with an extra bucket (vocab_size) that is dropped afterwards.
    padded = torch.tensor(
        [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids], dtype=torch.int64, device=device
    ).reshape(len(token_ids), max_len)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams], rows: list[int]
) -> list[TokenLogprobs]:
    """Logprob, rank and top-N of each sampled token, for ``rows`` (which asked for logprobs).

    ``raw_logprobs``: [len(rows), vocab] log_softmax of the unprocessed logits;
    ``token_ids``: [len(rows)] the tokens sampled in those rows.
    """
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    # vLLM counts >=, so a token tied with better ones gets the worst rank of the tie.
    ranks = (raw_logprobs >= sampled).sum(-1).tolist()
    num_top = min(max(params[i].logprobs or 0 for i in rows), raw_logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if num_top > 0:
        values, ids = raw_logprobs.topk(num_top, dim=-1)  # sorted, most likely first
        top_values, top_ids = values.tolist(), ids.tolist()

    result = []
    for j, (i, token_id, logprob) in enumerate(zip(rows, token_ids.tolist(), sampled.squeeze(1).tolist())):
        n = params[i].logprobs or 0
        result.append(
            TokenLogprobs(
                token_id=token_id,
                logprob=logprob,
                rank=ranks[j],
                top_logprobs=list(zip(top_ids[j][:n], top_values[j][:n])),
            )
        )
    return result
