"""What an engine tells the world about its load: queue, KV use, and how fast it prefills."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own snapshot; ``serving/instance.py`` copies it into the wire's
    ``LoadReport`` message, with the instance's counters."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_pending_prefill_tokens: int = 0  # prompt tokens queued or mid-prefill
    prefill_tokens_per_s: float = 0.0  # recent prefill throughput; 0 until measured
    num_preemptions: int = 0  # since start
    num_steps: int = 0  # steps that ran the model, since start
    step_seconds: float = 0.0  # their model time, since start
    # Speculative decoding, since start: drafts verified, and those the target accepted; the
    # same by draft position; verifications by how many drafts they accepted
    # (engine/spec_decode/stats.py).
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_draft_tokens_per_pos: tuple[int, ...] = ()
    num_spec_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_spec_verifications_by_accepted: tuple[int, ...] = ()


class PrefillRate:
    """Prompt tokens per second over recent steps that computed prompt tokens: what the
    gateway divides queued prompt tokens by to estimate a new request's wait. Decayed sums
    weigh a step by its size, so one tiny chunk does not swing the estimate."""

    DECAY = 0.8  # per measured step

    def __init__(self) -> None:
        self._num_tokens = 0.0
        self._seconds = 0.0

    def add(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        self._num_tokens = self._num_tokens * self.DECAY + num_tokens
        self._seconds = self._seconds * self.DECAY + seconds

    @property
    def tokens_per_s(self) -> float:
        return self._num_tokens / self._seconds if self._seconds else 0.0
