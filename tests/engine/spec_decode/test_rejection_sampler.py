"""The rejection sampler on fixed distributions: what it emits is distributed as the target,
whatever the drafts' distribution (and a naive accept-every-draft scheme is caught)."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingMetadata
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection_sampler import RejectionSampler
from tests.engine.spec_decode.chi_square import goodness_of_fit

VOCAB = 6
TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 0.3, 1.5, -0.5, 0.2, 1.0]])  # rows: position 0, 1
DRAFT = torch.tensor([0.05, 0.1, 0.5, 0.2, 0.1, 0.05])  # q: far from the target's first row
NUM_REQUESTS = 4000


def metadata(params: SamplingParams, num_rows: int) -> SamplingMetadata:
    return SamplingMetadata([params] * num_rows, [[1]] * num_rows, [[]] * num_rows, [None] * num_rows, frozenset())


@pytest.mark.parametrize("draft_kind", ["draft_model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(draft_kind: str) -> None:
    torch.manual_seed(0)
    sampler = RejectionSampler(Sampler(seed=1))
    if draft_kind == "draft_model":
        drafts = torch.multinomial(DRAFT, NUM_REQUESTS, replacement=True).tolist()
        draft_probs = [DRAFT[None]] * NUM_REQUESTS
    else:  # deterministic drafts (q a point mass): always the same guess, right or wrong
        drafts = [1] * NUM_REQUESTS
        draft_probs = None
    logits = TARGET.repeat(NUM_REQUESTS, 1)  # [2 * NUM_REQUESTS, VOCAB]
    out = sampler(
        logits, metadata(SamplingParams(temperature=1.0), 2 * NUM_REQUESTS), [[d] for d in drafts], draft_probs
    )

    first = [(a[0] if a else t) for a, t in zip(out.accepted_token_ids, out.token_ids)]
    p_first = TARGET[0].softmax(-1).tolist()
    assert goodness_of_fit([first.count(v) for v in range(VOCAB)], p_first) > 1e-3
    # After an accepted draft, the bonus token is drawn from the next position's distribution.
    bonus = [t for a, t in zip(out.accepted_token_ids, out.token_ids) if a]
    assert goodness_of_fit([bonus.count(v) for v in range(VOCAB)], TARGET[1].softmax(-1).tolist()) > 1e-3
    # The test has the power to see a wrong scheme: taking every draft gives the draft's distribution.
    assert goodness_of_fit([drafts.count(v) for v in range(VOCAB)], p_first) < 1e-6
    assert sum(map(len, out.accepted_token_ids)) not in (0, NUM_REQUESTS)  # both branches ran


def test_greedy_accepts_the_argmax_prefix_and_adds_the_next_argmax() -> None:
    sampler = RejectionSampler(Sampler())
    logits = torch.eye(VOCAB)[[3, 1, 4, 1]] * 5  # argmax per row: 3, 1, 4, 1
    greedy = SamplingParams(temperature=0.0)
    out = sampler(logits, metadata(greedy, 4), [[3, 1, 5]])
    assert (out.accepted_token_ids, out.token_ids) == ([[3, 1]], [4])  # 5 rejected: 4 instead
    out = sampler(logits, metadata(greedy, 4), [[3, 1, 4]])
    assert (out.accepted_token_ids, out.token_ids) == ([[3, 1, 4]], [1])  # all accepted: bonus 1
    out = sampler(logits[:2], metadata(greedy, 2), [[], []])
    assert (out.accepted_token_ids, out.token_ids) == ([[], []], [3, 1])  # no drafts: plain argmax


def test_logprobs_of_every_emitted_token_come_from_its_own_position() -> None:
    sampler = RejectionSampler(Sampler())
    logits = torch.eye(VOCAB)[[3, 1, 4]] * 5
    out = sampler(logits, metadata(SamplingParams(temperature=0.0, logprobs=1), 3), [[3, 2]])
    assert out.accepted_token_ids == [[3]] and out.token_ids == [1]
    (accepted,) = out.accepted_logprobs[0]
    assert accepted is not None and accepted.token_id == 3 and accepted.rank == 1
    expected = torch.log_softmax(logits[1], -1)[1].item()
    assert out.logprobs[0] is not None and out.logprobs[0].logprob == pytest.approx(expected)
