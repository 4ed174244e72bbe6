"""What to speculate with, and how far ahead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpecMethod = Literal["ngram", "draft_model", "medusa", "eagle", "eagle3"]
SPEC_METHODS: tuple[SpecMethod, ...] = ("ngram", "draft_model", "medusa", "eagle", "eagle3")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# The methods EAGLE's proposer drives (engine/spec_decode/eagle.py): EAGLE-1/2's draft and EAGLE-3's.
EAGLE_METHODS: frozenset[SpecMethod] = frozenset({"eagle", "eagle3"})


@dataclass(slots=True)
class SpeculativeConfig:
    """``method="ngram"`` drafts by prompt lookup: the longest n-gram (``ngram_max`` down to
    ``ngram_min`` tokens) ending the sequence is searched for earlier in it, and the tokens
    that followed its latest earlier occurrence are proposed. ``method="draft_model"`` runs
    ``model`` (a local Hugging Face folder with the target's vocabulary) autoregressively.
    ``method="medusa"`` reads ``model``'s Medusa heads, which draft from the target's last
    hidden state (engine/spec_decode/medusa.py). ``method="eagle"`` reads ``model``'s EAGLE
    draft, a decoder layer over the target's features (engine/spec_decode/eagle.py);
    ``method="eagle3"`` an EAGLE-3 draft, which fuses three of the target's layers and drafts in a
    vocabulary of its own (engine/spec_decode/eagle3_draft.py). Either way at most
    ``num_speculative_tokens`` drafts are verified per step.

    ``disable_by_batch_size`` (vLLM's key): from a batch of that many requests up, no drafts are
    proposed or verified, because a step's extra rows then cost more than the accepted drafts
    save (docs/benchmarks.md measures where, per method); speculation resumes, exact, as soon as
    the batch is smaller again (an EAGLE draft then starts its KV afresh: it keeps none up while
    turned down)."""

    method: SpecMethod = "ngram"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    ngram_min: int = 2
    ngram_max: int = 4
    model: str | None = None  # draft_model, eagle, eagle3: the draft checkpoint's folder; medusa: the heads' folder
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}; got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= --speculative-ngram-min <= --speculative-ngram-max, got {self.ngram_min} and "
                f"{self.ngram_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(
                f"disable_by_batch_size must be at least 2 (a batch of one always speculates), got "
                f"{self.disable_by_batch_size}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("draft-model speculation needs --speculative-model, a local Hugging Face folder")
        if self.method == "medusa" and not self.model:
            raise ValueError(
                'Medusa speculation needs the heads\' folder: --speculative-config \'{"method": "medusa", "model": '
                '"<folder>"}\' (splitserve train-heads makes one)'
            )
        if self.method == "eagle" and not self.model:
            raise ValueError(
                'EAGLE speculation needs the draft\'s folder: --speculative-config \'{"method": "eagle", "model": '
                "\"<folder>\"}' (EAGLE's reference layout or the speculators package's)"
            )
        if self.method == "eagle3" and not self.model:
            raise ValueError(
                'EAGLE-3 speculation needs the draft\'s folder: --speculative-config \'{"method": "eagle3", "model": '
                "\"<folder>\"}' (EAGLE's reference layout or the speculators package's)"
            )
        if self.method == "ngram" and self.model:
            raise ValueError("--speculative-model makes a draft model speculate; drop the n-gram method (or the model)")

    def speculates_at(self, batch_size: int) -> bool:
        """Whether a batch of ``batch_size`` requests proposes and verifies drafts."""
        return self.disable_by_batch_size is None or batch_size < self.disable_by_batch_size

    @property
    def drafts_after_step(self) -> bool:
        """Whether the drafter proposes after each step from the target's hidden states (Medusa,
        EAGLE, EAGLE-3): P proposes once after the first token too, and its drafts cross the
        hand-off for D to verify at its first step."""
        return self.method == "medusa" or self.method in EAGLE_METHODS
