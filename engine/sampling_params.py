"""Per-request sampling parameters, named as users know them from vLLM and the OpenAI API."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured_output.spec import StructuredOutputSpec

# Temperatures below this are treated as greedy: dividing logits by ~0 only
# produces inf/nan, and every serving stack users compare us with does the same.
_GREEDY_EPSILON = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Validation happens in ``__post_init__``: a bad value raises ``ValueError``
    naming the field and the accepted range, before the request reaches the engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM accepts) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N >= 0: sampled token plus top-N
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Guided decoding: every output token must keep the output inside this grammar.
    # Speculative decoding must not draft for such a request (its drafts are not
    # masked): check ``structured is not None`` before proposing tokens.
    structured: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 or -1 disables it)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must be <= max_tokens ({self.max_tokens})",
            )
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", self.logprobs, "must be in [0, 20]")
        _check(all(s for s in self.stop), "stop", self.stop, "must not contain empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def can_speculate(self) -> bool:
        """Whether the engine may verify draft tokens for this request (speculative decoding).
        Every other parameter is honoured exactly at each draft position (rejection sampling
        keeps the distribution); a request under a grammar (structured outputs) does not
        speculate until the grammar can be advanced over drafts and rolled back."""
        return self.structured is None

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
