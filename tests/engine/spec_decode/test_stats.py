"""Speculation counts by depth: what each verification adds, exactly."""

from __future__ import annotations

import pytest

from engine.spec_decode.stats import SpecDecodeStats


def test_counts_by_depth_and_the_accepted_length_histogram() -> None:
    stats = SpecDecodeStats()
    stats.add(3, 2)  # drafts at depths 0, 1, 2; the first two accepted
    stats.add(3, 0)
    stats.add(1, 1)  # a shorter chain (the budget or max_tokens cut it)
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (7, 3)
    assert stats.num_drafts_at == [3, 2, 2]
    assert stats.num_accepted_at == [2, 1, 0]
    assert stats.accepted_length_counts == [1, 1, 1, 0]  # 0, 1 and 2 accepted once each, 3 never
    assert stats.acceptance_rate_at == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert stats.mean_accepted_length == pytest.approx(1.0)


def test_no_verification_yet() -> None:
    stats = SpecDecodeStats()
    assert (stats.acceptance_rate_at, stats.mean_accepted_length, stats.accepted_length_counts) == ([], 0.0, [])
