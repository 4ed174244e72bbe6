"""Speculative decoding counts since start: how much was drafted, how much of it the target kept,
and where in the chain drafts stop being kept (what tells a drafter's depth worth its cost)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts the target accepted (each one a token gained)
    # Index j: drafts verified at depth j of their chain (0: the first draft after the last
    # known token), and those accepted there; a draft is accepted only if all before it were.
    num_drafts_at: list[int] = field(default_factory=list)
    num_accepted_at: list[int] = field(default_factory=list)
    # Index n: verifications (one request's drafts in one step) that accepted exactly n drafts.
    accepted_length_counts: list[int] = field(default_factory=list)

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        _grow(self.num_drafts_at, num_draft_tokens)
        _grow(self.num_accepted_at, num_draft_tokens)
        _grow(self.accepted_length_counts, num_draft_tokens + 1)
        for depth in range(num_draft_tokens):
            self.num_drafts_at[depth] += 1
        for depth in range(num_accepted_tokens):
            self.num_accepted_at[depth] += 1
        self.accepted_length_counts[num_accepted_tokens] += 1

    @property
    def acceptance_rate_at(self) -> list[float]:
        """Per depth, the share of drafts verified there that were accepted."""
        return [accepted / drafted for accepted, drafted in zip(self.num_accepted_at, self.num_drafts_at) if drafted]

    @property
    def mean_accepted_length(self) -> float:
        """Drafts accepted per verification (tokens gained per step over plain decoding)."""
        num_verifications = sum(self.accepted_length_counts)
        return self.num_accepted_tokens / num_verifications if num_verifications else 0.0


def _grow(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))
