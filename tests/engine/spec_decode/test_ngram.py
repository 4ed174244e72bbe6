from __future__ import annotations

import pytest

from engine.spec_decode.ngram import NgramProposer


def test_longest_suffix_wins_over_a_later_shorter_match() -> None:
    # The 3-gram [1, 2, 3] occurred at 0 (followed by 4, 5); the 2-gram [2, 3] also at 6 (then 9).
    tokens = [1, 2, 3, 4, 5, 0, 2, 3, 9, 9, 9, 7, 1, 2, 3]
    assert NgramProposer(2, 3, 2).propose(tokens) == [4, 5]
    assert NgramProposer(2, 2, 2).propose(tokens) == [9, 9]


def test_latest_occurrence_with_a_full_run_of_drafts() -> None:
    tokens = [5, 6, 1, 2, 5, 6, 3, 4, 9, 5, 6]
    assert NgramProposer(2, 2, 2).propose(tokens) == [3, 4]
    assert NgramProposer(2, 2, 4).propose(tokens) == [3, 4, 9, 5]
    # Only the first occurrence has six tokens after it.
    assert NgramProposer(2, 2, 6).propose(tokens) == [1, 2, 5, 6, 3, 4]
    # None has ten: the latest.
    assert NgramProposer(2, 2, 10).propose(tokens) == [3, 4, 9, 5, 6]


def test_no_match_below_ngram_min_and_caps() -> None:
    tokens = [1, 2, 3, 4, 8, 3]
    assert NgramProposer(2, 4, 3).propose(tokens) == []
    assert NgramProposer(1, 4, 3).propose(tokens) == [4, 8, 3]
    assert NgramProposer(1, 4, 3).propose(tokens, max_num_drafts=1) == [4]
    assert NgramProposer(1, 4, 3).propose(tokens, max_num_drafts=0) == []
    assert NgramProposer(2, 4, 3).propose([7, 7]) == []


@pytest.mark.parametrize("length", [1, 2, 5, 300])
def test_agrees_with_a_brute_force_search(length: int) -> None:
    import random

    rng = random.Random(length)
    proposer = NgramProposer(1, 3, 4)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(length)]
        expected: list[int] = []
        for n in range(min(3, len(tokens) - 1), 0, -1):
            suffix = tokens[len(tokens) - n :]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                full = [i for i in starts if i + n + 4 <= len(tokens)]
                follow = (full or starts)[-1] + n
                expected = tokens[follow : follow + 4]
                break
        assert proposer.propose(tokens) == expected
