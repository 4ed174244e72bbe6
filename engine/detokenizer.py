"""Turn one request's generated token ids into streamable text, applying stop strings.

Used by the engine and by the gateway, so it must not import torch.

Text comes from ``tokenizers.decoders.DecodeStream``, which holds back a token
until it completes a UTF-8 character (byte-level BPE splits emoji and CJK across
tokens) and decodes each token in the context of the ones before it, so a
SentencePiece ``▁word`` after the prompt keeps its leading space.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Prompt ids fed to DecodeStream as context. The decoders only look back a token
# or so (leading-space rules, partial UTF-8), and DecodeStream decodes all of its
# seed on the first step, so a long prompt would cost O(prompt) for nothing.
_NUM_PROMPT_CONTEXT_IDS = 8
_REPLACEMENT_CHAR = "\ufffd"  # what decoders print for incomplete UTF-8
# DecodeStream raises a plain Exception with this message when a decoder rewrites
# text it already returned (byte-fallback tokens that form invalid UTF-8).
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


@dataclass(slots=True)
class DetokenizerUpdate:
    text_delta: str  # new text safe to stream to the client now
    stop_string: str | None  # the stop string this update matched; the request finishes with reason "stop"


class IncrementalDetokenizer:
    """Decodes one request's output as it is generated.

    ``update`` is called with each batch of new token ids, ``flush`` once when the
    request finishes without a stop string. The concatenation of every
    ``text_delta`` and the flushed text equals decoding all output ids at once
    (without transformers' ``clean_up_tokenization_spaces``, which only WordPiece
    tokenizers enable).

    Stop strings end the output at the first place one completes, as if text
    arrived a character at a time, so the result does not depend on how tokens
    were batched into updates. The last ``len(longest stop) - 1`` characters are
    held back because they may be the start of a stop string that completes later.
    """

    __slots__ = (
        "_backend",
        "_skip_special_tokens",
        "_stream",
        "_stop",
        "_include_stop",
        "_num_held_chars",
        "_text",
        "_num_emitted_chars",
        "_finished",
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ValueError(
                f"streaming detokenization needs a fast (tokenizers-backed) tokenizer, got "
                f"{type(tokenizer).__name__}; load it with AutoTokenizer.from_pretrained(..., use_fast=True) "
                "from a model that ships tokenizer.json"
            )
        self._backend: Tokenizer = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = self._seeded_stream(prompt_token_ids)
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._num_held_chars = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # all decoded output; cut at the stop string once one matches
        self._num_emitted_chars = 0
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far, after any stop-string truncation."""
        return self._text[: self._num_emitted_chars]

    def update(self, new_token_ids: list[int]) -> DetokenizerUpdate:
        """Decode new tokens and return the text that can be streamed now.

        Tokens after a matched stop string are ignored; the caller must finish
        the request and call neither ``update`` nor ``flush`` again.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.update called after the request finished; this is a bug")
        num_checked_chars = len(self._text)
        for token_id in new_token_ids:
            chunk = self._step(token_id)
            if chunk:
                self._text += chunk

        match = self._find_stop(num_checked_chars)
        if match is not None:
            stop_string, start = match
            end = start + len(stop_string) if self._include_stop else start
            self._text = self._text[:end]
            self._finished = True
            return DetokenizerUpdate(self._emit(end), stop_string)
        return DetokenizerUpdate(self._emit(len(self._text) - self._num_held_chars), None)

    def flush(self) -> str:
        """At finish without a stop string: the held-back text, to stream last."""
        self._finished = True
        return self._emit(len(self._text))

    def _seeded_stream(self, prompt_token_ids: list[int]) -> DecodeStream:
        context_ids = prompt_token_ids[-_NUM_PROMPT_CONTEXT_IDS:]
        # DecodeStream only treats its seed as already-printed text if the seed
        # decodes to whole characters; otherwise the prompt would leak into the
        # output. So seed with the longest tail that does, and step the rest
        # (a prompt cut mid-character) so its bytes join the first output char.
        for num_seed_ids in range(len(context_ids), 0, -1):
            seed_ids = context_ids[:num_seed_ids]
            text = self._backend.decode(seed_ids, skip_special_tokens=self._skip_special_tokens)
            if not text.endswith(_REPLACEMENT_CHAR):
                break
        else:
            seed_ids = []
        stream = DecodeStream(ids=seed_ids, skip_special_tokens=self._skip_special_tokens)
        if len(seed_ids) < len(context_ids):
            stream.step(self._backend, context_ids[len(seed_ids) :])
        return stream

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERROR):
                raise
            # Text already streamed cannot be taken back, so carry on from a fresh
            # stream; only the invalid bytes that caused this are lost.
            logger.warning("detokenizer: decoder rewrote streamed text (%s); restarting the decode stream", e)
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)

    def _find_stop(self, num_checked_chars: int) -> tuple[str, int] | None:
        """The stop string that completes first in the new text, and where it starts."""
        best: tuple[int, int, str] | None = None  # (end, start, stop): ties go to the longer stop
        for stop in self._stop:
            # A match ending in the new text starts at most len(stop) - 1 chars before it.
            start = self._text.find(stop, max(0, num_checked_chars - len(stop) + 1))
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[2], best[1])

    def _emit(self, end: int) -> str:
        if end <= self._num_emitted_chars:
            return ""
        delta = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta
