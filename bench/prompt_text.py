"""Prompt text of an exact token length, measured with the served model's tokenizer.

Prompts are sent as text, so the server tokenizes them; to know how many tokens a
prompt is, the benchmark builds it from the tokenizer's own whole-word tokens
(``" house"``, ``" river"``): under byte-level BPE each such word is one pre-token
and one token, so a string of N of them encodes to exactly N tokens. The count is
always checked by encoding, and corrected when a tokenizer merges across words.
Counts exclude special tokens (a BOS the server adds is the server's).

Only the fast tokenizer is loaded (``PreTrainedTokenizerFast``), never
``AutoTokenizer``: it would import torch, which the benchmark client must not need. A GGUF
file's tokenizer is read from its metadata by transformers' GGUF support, which does import
torch: a client given a ``.gguf`` path shares a host with the server that loaded it.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# Tokens that decode to a space and a lowercase word: under byte-level BPE one token each.
_SPACED_WORD = re.compile(r" [a-z]{2,}")
# Fallback for tokenizers whose single-token decode drops the leading space (SentencePiece).
_BARE_WORD = re.compile(r"[a-z]{2,}")
# With fewer whole-word tokens than this, random prompts could share long prefixes by chance.
_MIN_WORDS = 100
_MAX_FIT_ROUNDS = 32


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer of a Hugging Face folder or name, or of a ``.gguf`` file."""
    from transformers import PreTrainedTokenizerFast

    try:
        if is_gguf_file(path):
            return PreTrainedTokenizerFast.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"cannot load a fast tokenizer from {path} ({error}); pass --tokenizer PATH, "
            "a Hugging Face folder with tokenizer.json or a .gguf file"
        ) from error


class PromptSynthesizer:
    """Random word text of a requested token length for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        decoded = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
        special_ids = set(tokenizer.all_special_ids)
        candidates = [text for token_id, text in enumerate(decoded) if token_id not in special_ids]
        words = self._single_tokens({text for text in candidates if _SPACED_WORD.fullmatch(text)})
        if len(words) < _MIN_WORDS:
            words = self._single_tokens({" " + text for text in candidates if _BARE_WORD.fullmatch(text)})
        if len(words) < _MIN_WORDS:
            raise ValueError(
                f"the tokenizer has only {len(words)} whole-word tokens to build prompts from; "
                "pass --tokenizer PATH of the served text model"
            )
        self._words = words
        self._warned_inexact = False

    def _single_tokens(self, words: set[str]) -> list[str]:
        """The words that encode back to one token on their own (sorted: the seed alone decides)."""
        ordered = sorted(words)
        if not ordered:
            return []
        encoded = self.tokenizer(ordered, add_special_tokens=False)["input_ids"]
        return [word for word, ids in zip(ordered, encoded) if len(ids) == 1]

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, rng: random.Random, num_tokens: int, head: str = "") -> tuple[str, int]:
        """Random text to append to ``head`` so that ``head + text`` encodes to
        ``num_tokens(head) + num_tokens`` tokens. Returns the text and the token count
        of ``head + text`` as measured (equal to the target unless the tokenizer makes
        it unreachable, which is logged)."""
        if num_tokens < 0:
            raise ValueError(f"a prompt length must be >= 0, got {num_tokens}")
        target = (self.num_tokens(head) if head else 0) + num_tokens
        words = rng.choices(self._words, k=num_tokens)
        measured = self.num_tokens(head + "".join(words))
        for _ in range(_MAX_FIT_ROUNDS):
            excess = measured - target
            if excess == 0:
                return "".join(words), measured
            if excess > 0:
                del words[max(len(words) - excess, 0) :]
            else:
                words.extend(rng.choices(self._words, k=-excess))
            measured = self.num_tokens(head + "".join(words))
        # Word steps oscillate around the target: cut at token level as a last resort.
        ids = self.tokenizer.encode(head + "".join(words), add_special_tokens=False)[:target]
        text = self.tokenizer.decode(ids)
        text = text[len(head) :] if head and text.startswith(head) else "".join(words)
        measured = self.num_tokens(head + text)
        if measured != target and not self._warned_inexact:
            self._warned_inexact = True
            logger.warning(
                "this tokenizer cannot hit every prompt length exactly (e.g. %d for %d); "
                "the measured lengths are reported",
                measured,
                target,
            )
        return text, measured
