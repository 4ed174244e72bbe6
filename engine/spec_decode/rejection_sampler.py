"""Verify drafts against the target's distribution: accept a prefix, add one token.

For a request with drafts ``d_1..d_k`` the target's logits come in ``k + 1`` rows: row ``j``
is the distribution ``p_j`` of the token after ``d_j`` (row 0: after the last known token).
Every row is processed exactly as the plain sampler processes its one row (penalties and
min_tokens see the drafts before it as output), so:

- greedy: ``d_j`` is accepted while it is the argmax of row ``j - 1``; the first mismatch is
  replaced by that argmax, and when all match the argmax of row ``k`` is added (the bonus).
  The output is token for token the non-speculative greedy output.
- sampled: ``d_j``, drawn from the draft's distribution ``q_j``, is accepted with probability
  ``min(1, p(d_j) / q(d_j))``; on rejection a token is drawn from ``max(p - q, 0)``
  renormalized, and after k acceptances a bonus from ``p_k``. This is the rejection sampling
  of Leviathan et al. (2023) and Chen et al. (2023): each emitted token is distributed exactly
  as the target's. An n-gram draft is deterministic (``q`` a point mass): it is accepted with
  probability ``p(d_j)``, and a rejection draws from ``p`` without ``d_j``.

Logprobs of every emitted token are those of the raw target distribution at its position,
as the plain sampler reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import (
    Sampler,
    SamplingMetadata,
    TokenLogprobs,
    _gather_logprobs,
    _needs_processing,
    apply_min_tokens,
    apply_penalties,
    processed_probs,
)
from engine.structured_output.bitmask import apply_token_bitmask


@dataclass(slots=True)
class VerifyOutput:
    """Per request, in order: the drafts accepted, then the one token sampled after them."""

    accepted_token_ids: list[list[int]]
    accepted_logprobs: list[list[TokenLogprobs | None]]
    token_ids: list[int]  # the bonus (all drafts accepted) or recovered token
    logprobs: list[TokenLogprobs | None]


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # its generator serves requests without a seed

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> VerifyOutput:
        """Called by the model runner for a step in which some request verifies drafts.

        ``logits``: [R, vocab], ``len(draft_token_ids[i]) + 1`` rows per request (a request
        with no drafts has one row and is simply sampled); ``metadata`` describes each row,
        ``output_token_ids`` of row ``j`` of a request ending with its first ``j`` drafts.
        ``draft_probs[i]``: [k_i, vocab] the distributions request i's drafts were drawn from
        (None: deterministic drafts, n-gram or greedy).
        """
        num_rows = logits.shape[0]
        if sum(len(d) + 1 for d in draft_token_ids) != num_rows or len(metadata.params) != num_rows:
            raise RuntimeError(f"bug: {num_rows} logits rows do not match the drafts and the sampling metadata")
        params = metadata.params
        raw_logprobs = None
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not _needs_processing(metadata):
            target_ids = logits.argmax(-1).tolist()  # every row plain greedy
            probs, random_row_index = None, {}
        else:
            processed = logits.to(torch.float32, copy=True)  # [R, vocab]
            if logprob_rows:
                raw_logprobs = processed[logprob_rows].log_softmax(-1)
            apply_penalties(processed, params, metadata.prompt_token_ids, metadata.output_token_ids)
            apply_min_tokens(processed, params, metadata.output_token_ids, metadata.eos_token_ids)
            if metadata.grammar_bias is not None:  # rows of requests under a grammar (never drafting)
                apply_token_bitmask(processed, metadata.grammar_rows, metadata.grammar_bias)
            target_ids = processed.argmax(-1).tolist()
            random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
            probs = None
            random_row_index = {row: index for index, row in enumerate(random_rows)}
            if random_rows:
                probs = processed_probs(processed[random_rows], [params[i] for i in random_rows])
                probs.div_(probs.sum(-1, keepdim=True))  # min-p leaves rows unnormalized

        out = VerifyOutput([], [], [], [])
        emitted_rows: list[int] = []
        emitted_ids: list[int] = []
        row = 0
        for index, drafts in enumerate(draft_token_ids):
            if params[row].is_greedy:
                accepted, token_id = _verify_greedy(target_ids[row : row + len(drafts) + 1], drafts)
            else:
                q = None if draft_probs is None else draft_probs[index]
                accepted, token_id = self._verify_sampled(
                    probs,
                    random_row_index[row],
                    drafts,
                    q,
                    metadata.generators[row],  # type: ignore[arg-type]
                )
            out.accepted_token_ids.append(accepted)
            out.token_ids.append(token_id)
            emitted_rows.extend(range(row, row + len(accepted) + 1))
            emitted_ids.extend([*accepted, token_id])
            row += len(drafts) + 1

        logprobs_of: dict[int, TokenLogprobs] = {}
        if raw_logprobs is not None:
            position = {r: i for i, r in enumerate(logprob_rows)}
            rows = [r for r in emitted_rows if r in position]
            if rows:
                ids = torch.tensor(
                    [t for r, t in zip(emitted_rows, emitted_ids) if r in position], device=logits.device
                )
                entries = _gather_logprobs(raw_logprobs[[position[r] for r in rows]], ids, params, rows)
                logprobs_of = dict(zip(rows, entries))
        row = 0
        for drafts, accepted in zip(draft_token_ids, out.accepted_token_ids):
            out.accepted_logprobs.append([logprobs_of.get(row + j) for j in range(len(accepted))])
            out.logprobs.append(logprobs_of.get(row + len(accepted)))
            row += len(drafts) + 1
        return out

    def _verify_sampled(
        self,
        probs: torch.Tensor,
        first: int,
        drafts: list[int],
        draft_probs: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> tuple[list[int], int]:
        """``probs[first : first + len(drafts) + 1]``: the request's processed target rows."""
        k = len(drafts)
        rows = probs[first : first + k + 1]  # [k + 1, vocab]
        accepted: list[int] = []
        if k:
            draft_index = torch.tensor(drafts, device=probs.device)
            p_draft = rows[:k].gather(1, draft_index[:, None]).squeeze(1)  # [k]
            if draft_probs is not None:
                q_draft = draft_probs.gather(1, draft_index[:, None]).squeeze(1)
                accept_prob = (p_draft / q_draft.clamp_min(torch.finfo(torch.float32).tiny)).clamp_max(1.0)
            else:
                accept_prob = p_draft
            uniforms = torch.rand(
                k, generator=generator or self.sampler.generator, device=_generator_device(generator, probs)
            )
            accepts = (uniforms.to(probs.device) < accept_prob).tolist()
            for j, ok in enumerate(accepts):
                if not ok:
                    residual = rows[j].clone()
                    if draft_probs is None:
                        residual[drafts[j]] = 0.0
                    else:
                        residual.sub_(draft_probs[j]).clamp_min_(0.0)
                    if not residual.sum() > 0:  # p == q: a rejection had probability 0
                        residual = rows[j].clone()
                    return accepted, int(self.sampler.race(residual[None], [generator])[0])
                accepted.append(drafts[j])
        return accepted, int(self.sampler.race(rows[k : k + 1].clone(), [generator])[0])


def _verify_greedy(target_ids: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """``target_ids``: the argmax of each of the request's rows."""
    for j, draft in enumerate(drafts):
        if target_ids[j] != draft:
            return drafts[:j], target_ids[j]
    return list(drafts), target_ids[len(drafts)]


def _generator_device(generator: torch.Generator | None, probs: torch.Tensor) -> torch.device:
    return generator.device if generator is not None else probs.device
