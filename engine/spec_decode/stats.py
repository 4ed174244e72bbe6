"""Speculative decoding counts since start: how much was drafted, how much of it the target kept."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpecDecodeStats:
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts the target accepted (each one a token gained)

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
