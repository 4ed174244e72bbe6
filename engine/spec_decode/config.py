"""What to speculate with, and how far ahead."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

SpecMethod = Literal["ngram", "draft_model"]
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass(slots=True)
class SpeculativeConfig:
    """``method="ngram"`` drafts by prompt lookup: the longest n-gram (``ngram_max`` down to
    ``ngram_min`` tokens) ending the sequence is searched for earlier in it, and the tokens
    that followed its latest earlier occurrence are proposed. ``method="draft_model"`` runs
    ``model`` (a local Hugging Face folder with the target's vocabulary) autoregressively.
    Either way at most ``num_speculative_tokens`` drafts are verified per step."""

    method: SpecMethod = "ngram"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    ngram_min: int = 2
    ngram_max: int = 4
    model: str | None = None  # draft_model: the draft checkpoint's folder

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method must be ngram or draft_model, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= --speculative-ngram-min <= --speculative-ngram-max, got {self.ngram_min} and "
                f"{self.ngram_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("draft-model speculation needs --speculative-model, a local Hugging Face folder")
        if self.method == "ngram" and self.model:
            raise ValueError("--speculative-model makes a draft model speculate; drop the n-gram method (or the model)")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that runs a decoding engine (decode, colocated, up, generate)."""
    group = parser.add_argument_group("speculative decoding (off unless one of the first two is given)")
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="drafts verified per step; alone, turns on n-gram (prompt lookup) drafting (try 4)",
    )
    group.add_argument(
        "--speculative-model",
        default=None,
        help="draft model: a local Hugging Face folder with the target's vocabulary (default: n-gram)",
    )
    group.add_argument("--speculative-ngram-min", type=int, default=2, help="shortest suffix n-gram looked up")
    group.add_argument("--speculative-ngram-max", type=int, default=4, help="longest suffix n-gram looked up")


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """None (speculation off) unless ``--num-speculative-tokens`` or ``--speculative-model`` was given."""
    if args.num_speculative_tokens is None and args.speculative_model is None:
        return None
    return SpeculativeConfig(
        method="draft_model" if args.speculative_model else "ngram",
        num_speculative_tokens=args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS,
        ngram_min=args.speculative_ngram_min,
        ngram_max=args.speculative_ngram_max,
        model=args.speculative_model,
    )


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The same flags again, for a launcher passing them on to its instances."""
    argv: list[str] = []
    if args.num_speculative_tokens is not None:
        argv += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.speculative_model is not None:
        argv += ["--speculative-model", str(args.speculative_model)]
    if argv:
        argv += ["--speculative-ngram-min", str(args.speculative_ngram_min)]
        argv += ["--speculative-ngram-max", str(args.speculative_ngram_max)]
    return argv
