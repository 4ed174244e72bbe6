"""Sampler: penalties, min_tokens, greedy / top-k / top-p / min-p sampling, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    Sampler,
    SamplingMetadata,
    _apply_top_k,
    _apply_top_k_top_p,
    apply_min_tokens,
    apply_penalties,
)
from engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def make_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata(
        params=params,
        prompt_token_ids=prompt_token_ids or [[] for _ in range(num_rows)],
        output_token_ids=output_token_ids or [[] for _ in range(num_rows)],
        generators=generators or [None] * num_rows,
        eos_token_ids=eos_token_ids,
    )


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=make_generator(seed)) * 3


def counts_of(token_ids: list[int], vocab_size: int) -> list[int]:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).tolist()


# --- greedy ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_greedy_batch_returns_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(7, 50).to(dtype)
    before = logits.clone()
    out = Sampler()(logits, make_metadata([SamplingParams(temperature=0.0) for _ in range(7)]))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 7
    assert torch.equal(logits, before)


def test_greedy_row_beside_random_rows_keeps_argmax() -> None:
    logits = random_logits(4, 50)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)] * 2
    out = Sampler()(logits, make_metadata(params))
    assert out.token_ids[1] == logits[1].argmax().item()
    assert out.token_ids[3] == logits[3].argmax().item()


# --- penalties -------------------------------------------------------------


def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # no penalties: untouched, though it shares the batch
        SamplingParams(presence_penalty=-1.0),
    ]
    prompt_token_ids = [[0, 1], [0, 1, 2], [0]]
    output_token_ids = [[3, 3, 2], [3, 3], [4, 4, 4]]
    apply_penalties(logits, params, prompt_token_ids, output_token_ids)
    expected = torch.tensor(
        [
            # token 0: prompt, 2 / 2; token 1: prompt, -1 * 2; token 2: output once,
            # 0.5 / 2 - 0.5 - 0.25; token 3: output twice, 3 / 2 - 2 * 0.5 - 0.25; token 4 unseen.
            [1.0, -2.0, -0.5, 0.25, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
            # presence only: output token 4 gains 1 once, however often it occurred; prompt tokens untouched.
            [2.0, -1.0, 0.5, 3.0, -1.0],
        ]
    )
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_repetition_penalty_covers_prompt_and_output_but_frequency_only_output() -> None:
    logits = torch.tensor([[4.0, 4.0, 4.0, -4.0]])
    params = [SamplingParams(repetition_penalty=4.0, frequency_penalty=1.0)]
    apply_penalties(logits, params, prompt_token_ids=[[0, 3]], output_token_ids=[[1]])
    torch.testing.assert_close(logits, torch.tensor([[1.0, 0.0, 4.0, -16.0]]), rtol=0, atol=0)


def test_penalty_changes_greedy_choice_end_to_end() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    out = Sampler()(logits, make_metadata(params, output_token_ids=[[0]]))
    assert out.token_ids == [1]
    assert torch.equal(logits, torch.tensor([[3.0, 2.5, 0.0]]))  # the caller's tensor is not modified


# --- min_tokens ------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 6)
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[1, 99]),  # 99 lies beyond the vocabulary
        SamplingParams(min_tokens=3, stop_token_ids=[1]),
        SamplingParams(min_tokens=3, stop_token_ids=[1], ignore_eos=True),
    ]
    apply_min_tokens(logits, params, output_token_ids=[[7, 7], [7, 7, 7], []], eos_token_ids=frozenset({5, 4}))
    expected = torch.tensor(
        [
            [0.0, NEG_INF, 0.0, 0.0, NEG_INF, NEG_INF],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # min_tokens reached
            [0.0, NEG_INF, 0.0, 0.0, NEG_INF, NEG_INF],  # EOS masked even with ignore_eos, as in vLLM
        ]
    )
    assert torch.equal(logits, expected)


def test_min_tokens_steers_greedy_and_random_rows_away_from_eos() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=1.0, min_tokens=2, top_k=2)]
    metadata = make_metadata(params, output_token_ids=[[3], [3]], eos_token_ids=frozenset({0}))
    out = Sampler()(logits, metadata)
    # EOS (0) is masked: greedy takes token 1; top_k=2 now keeps {1, 2} only.
    assert out.token_ids[0] == 1
    assert out.token_ids[1] in (1, 2)


# --- top-k / top-p / min-p -------------------------------------------------


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(64, 100, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1) for _ in range(64)]
    out = Sampler(seed=3)(logits, make_metadata(params))
    assert out.token_ids == logits.argmax(-1).tolist()


# 1e-9: 1 - top_p rounds to 1.0 in float32, so only the always-keep-the-top rule saves the row.
@pytest.mark.parametrize("top_p", [1e-6, 1e-9])
def test_tiny_top_p_keeps_only_the_top_token(top_p: float) -> None:
    logits = random_logits(64, 100, seed=2)
    params = [SamplingParams(temperature=1.0, top_p=top_p) for _ in range(64)]
    out = Sampler(seed=3)(logits, make_metadata(params))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # probs 0.5, 0.3, 0.2: top_p=0.7 needs {0, 1} (0.8 >= 0.7); 0.5 alone falls short.
    num_rows = 2000
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]]).expand(num_rows, 3)
    params = [SamplingParams(top_p=0.7) for _ in range(num_rows)]
    counts = counts_of(Sampler(seed=5)(logits, make_metadata(params)).token_ids, 3)
    assert counts[2] == 0
    # Renormalized 0.625 / 0.375 over 2000 draws.
    assert abs(counts[0] - 1250) < 120 and abs(counts[1] - 750) < 120


def test_top_k_keeps_k_most_likely() -> None:
    num_rows = 2000
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]]).expand(num_rows, 5)
    params = [SamplingParams(top_k=2) for _ in range(num_rows)]
    counts = counts_of(Sampler(seed=6)(logits, make_metadata(params)).token_ids, 5)
    assert counts[0] == counts[2] == counts[4] == 0
    assert counts[1] > 0 and counts[3] > 0


def test_top_k_masks_below_kth_value_in_both_paths() -> None:
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 2.9, -1.0],
            [0.0, 3.0, 1.0, 2.9, -1.0],  # top-k disabled
            [1.0, 1.0, 1.0, 0.0, 2.0],  # ties with the 2nd largest value survive
        ]
    )
    top_k = [2, 0, 2]
    expected_kept = torch.tensor(
        [
            [False, True, False, True, False],
            [True, True, True, True, True],
            [True, True, True, False, True],
        ]
    )
    top_k_only = logits.clone()
    _apply_top_k(top_k_only, top_k)
    with_sort = _apply_top_k_top_p(logits, torch.tensor([2, 5, 2]), torch.ones(3))
    for masked in (top_k_only, with_sort):
        assert torch.equal(masked > float("-inf"), expected_kept)
        assert torch.equal(masked[expected_kept], logits[expected_kept])


def test_top_p_applies_to_top_k_survivors() -> None:
    # top_k=2 leaves 0.4 / 0.3, renormalized 4/7 >= 0.5, so top_p=0.5 keeps token 0 alone;
    # on the full distribution it would have kept {0, 1}.
    num_rows = 500
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().expand(num_rows, 4)
    params = [SamplingParams(top_k=2, top_p=0.5) for _ in range(num_rows)]
    assert Sampler(seed=8)(logits, make_metadata(params)).token_ids == [0] * num_rows


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    # min_p=0.2 of top prob 0.5 -> threshold 0.1: drops token 3 (0.05) only.
    num_rows = 2000
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([probs]).log().expand(num_rows, 4)
    params = [SamplingParams(min_p=0.2) for _ in range(num_rows)]
    counts = counts_of(Sampler(seed=7)(logits, make_metadata(params)).token_ids, 4)
    assert counts[3] == 0
    assert all(c > 0 for c in counts[:3])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sample_frequencies_match_softmax(temperature: float) -> None:
    num_rows, vocab_size = 20000, 6
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    logits = row.expand(num_rows, vocab_size)
    params = [SamplingParams(temperature=temperature) for _ in range(num_rows)]
    counts = torch.tensor(counts_of(Sampler(seed=11)(logits, make_metadata(params)).token_ids, vocab_size))
    expected = (row / temperature).softmax(-1) * num_rows
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001.
    assert chi_square < 20.5, (counts.tolist(), expected.tolist())


def test_seeded_row_frequencies_match_softmax() -> None:
    # One seeded request over many steps draws from its own generator each step.
    vocab_size, num_steps = 4, 4000
    row = torch.tensor([[0.0, 1.0, -1.0, 0.5]])
    sampler = Sampler()
    generator = make_generator(123)
    token_ids = [
        sampler(row, make_metadata([SamplingParams(seed=123)], generators=[generator])).token_ids[0]
        for _ in range(num_steps)
    ]
    expected = row[0].softmax(-1) * num_steps
    counts = torch.tensor(counts_of(token_ids, vocab_size))
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 16.3  # 3 degrees of freedom, P = 0.001


# --- seeds -----------------------------------------------------------------


def run_seeded_request(seed: int, batch_mates: int, position: int, num_steps: int = 8) -> list[int]:
    """Sample ``num_steps`` tokens for one seeded request sharing the batch with others."""
    vocab_size = 1000
    sampler = Sampler(seed=batch_mates)  # a different sampler stream for each composition
    own_generator = make_generator(seed)
    mate_generators = [make_generator(1000 + j) if j % 2 else None for j in range(batch_mates)]
    token_ids = []
    for step in range(num_steps):
        logits = random_logits(batch_mates + 1, vocab_size, seed=100 + step)
        # Our request's logits are the same every composition; the mates' differ.
        ours = random_logits(1, vocab_size, seed=step)[0]
        logits = torch.cat([logits[:position], ours[None], logits[position + 1 :]])
        params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=200) for _ in range(batch_mates + 1)]
        params[position] = SamplingParams(temperature=1.0, seed=seed)
        generators = list(mate_generators)
        generators.insert(position, own_generator)
        token_ids.append(sampler(logits, make_metadata(params, generators=generators)).token_ids[position])
    return token_ids


def test_seeded_request_reproduces_across_batch_compositions() -> None:
    alone = run_seeded_request(seed=42, batch_mates=0, position=0)
    assert run_seeded_request(seed=42, batch_mates=3, position=2) == alone
    assert run_seeded_request(seed=42, batch_mates=6, position=0) == alone


def test_different_seeds_give_different_tokens() -> None:
    assert run_seeded_request(seed=42, batch_mates=0, position=0) != run_seeded_request(
        seed=43, batch_mates=0, position=0
    )


# --- logprobs --------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = random_logits(3, 30, seed=4)
    params = [
        # Penalties and temperature change what is sampled, not what is reported.
        SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler(seed=9)(logits, make_metadata(params, output_token_ids=[[1, 2], [], []]))
    raw = logits.log_softmax(-1)

    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    top_values, top_ids = raw[0].topk(5)
    assert [t for t, _ in first.top_logprobs] == top_ids.tolist()
    assert [v for _, v in first.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert [v for _, v in first.top_logprobs] == sorted((v for _, v in first.top_logprobs), reverse=True)

    second = out.logprobs[1]
    assert second is not None and second.top_logprobs == [] and second.rank == 1
    assert second.logprob == pytest.approx(raw[1].max().item(), abs=1e-6)
    assert out.logprobs[2] is None


def test_logprobs_with_greedy_only_batch() -> None:
    logits = random_logits(2, 10, seed=8)
    out = Sampler()(logits, make_metadata([SamplingParams(temperature=0.0, logprobs=3)] * 2))
    assert out.token_ids == logits.argmax(-1).tolist()
    for row, entry in enumerate(out.logprobs):
        assert entry is not None and entry.rank == 1
        assert entry.top_logprobs[0][0] == out.token_ids[row]
        assert len(entry.top_logprobs) == 3


def test_rank_of_sampled_token_under_raw_distribution() -> None:
    # min_tokens masks the two most likely tokens, so greedy picks the third.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, 1.5]])
    params = [SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[1], logprobs=2)]
    out = Sampler()(logits, make_metadata(params, eos_token_ids=frozenset({0})))
    assert out.token_ids == [4]
    entry = out.logprobs[0]
    assert entry is not None
    assert entry.rank == 3
    assert entry.logprob == pytest.approx(logits.log_softmax(-1)[0, 4].item(), abs=1e-6)
    assert [t for t, _ in entry.top_logprobs] == [0, 1]


def test_metadata_length_mismatch_is_reported_as_bug() -> None:
    with pytest.raises(RuntimeError, match="bug"):
        Sampler()(torch.zeros(2, 5), make_metadata([SamplingParams()]))
