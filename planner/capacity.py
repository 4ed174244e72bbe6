"""What one instance of each role sustains within the SLOs, priced by a timing profile.

Pure functions of a :class:`~simulator.timing_model.TimingProfile`, a :class:`Workload` (mean
prompt and output lengths) and the SLOs; the planner divides the predicted request rate by
them (``planner/decision.py``).

- **Prefill.** Under load the scheduler packs waiting prompts into full steps of
  ``max_num_batched_tokens``, so an instance completes ``mu`` prompts a second (a full step of
  whole prompts, or one long prompt in chunks). A prompt's TTFT is its wait for the instance
  plus its own prefill alone plus the KV pull. The wait is priced as an M/M/1 queue's, whose
  tail has a closed form: ``P(wait > t) = rho * exp(-mu * (1 - rho) * t)``, so its p90 is
  ``ln(10 * rho) / (mu * (1 - rho))`` (0 while ``rho <= 0.1``). The capacity is the largest
  rate ``rho * mu`` whose TTFT p90 stays within the SLO (bisection on ``rho``).
- **Decode.** ``n`` streams at the mean context (prompt plus half the output) make one step of
  ``n`` decode rows; the instance holds the largest ``n`` whose step fits the ITL SLO, the
  scheduler's ``max_num_seqs`` and the KV cache (each stream's whole prompt and output). A
  Poisson number of streams with mean ``L`` stays at or below ``n`` in 90% of steps roughly
  when ``L + z90 * sqrt(L) <= n``; by Little's law that mean is the rate times a stream's
  duration (output tokens times the step time), which gives the rate.

Both are models, not measurements: docs/planner.md says where they are off.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from simulator.timing_model import TimingProfile

Z90 = 1.2816  # the standard normal's 90th percentile
_BISECTION_STEPS = 60


@dataclass(frozen=True, slots=True)
class Workload:
    """The traffic the pools must carry: requests a second and their mean lengths in tokens."""

    request_rate: float
    prompt_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.request_rate) and self.request_rate >= 0):
            raise ValueError(f"request_rate must be a finite number >= 0; got {self.request_rate}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"prompt_tokens and output_tokens must be >= 1; got {self.prompt_tokens}, {self.output_tokens}"
            )


@dataclass(frozen=True, slots=True)
class Slo:
    """The targets, both 90th percentiles, in seconds."""

    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"--ttft-slo and --itl-slo must be > 0 seconds; got {self.ttft_s}, {self.itl_s}")


@dataclass(frozen=True, slots=True)
class InstanceCapacity:
    """Requests a second one instance of each role sustains within the SLOs (0: never, the
    SLO is tighter than one request alone)."""

    prefill_rate: float
    decode_rate: float
    decode_streams: int  # streams one decode instance holds within the ITL SLO


def prefill_service_rate(profile: TimingProfile, prompt_tokens: int) -> float:
    """Prompts a second one busy prefill instance completes: whole prompts packed into full
    steps, or a prompt longer than a step in chunks of the step budget."""
    budget = profile.max_num_batched_tokens
    if prompt_tokens > budget:
        return 1.0 / profile.prefill_seconds(prompt_tokens)
    num_prompts = min(budget // prompt_tokens, profile.max_num_seqs)
    return num_prompts / profile.step_seconds([(prompt_tokens, prompt_tokens)] * num_prompts)


def wait_p90_s(rho: float, service_rate: float) -> float:
    """The p90 of an M/M/1 queue's wait at utilisation ``rho`` (module docstring)."""
    if not 0 <= rho < 1:
        raise ValueError(f"utilisation must be in [0, 1); got {rho}")
    if rho <= 0.1:
        return 0.0
    return math.log(10 * rho) / (service_rate * (1 - rho))


def prefill_capacity(profile: TimingProfile, workload: Workload, ttft_slo_s: float) -> float:
    """Requests a second one prefill instance takes with its TTFT p90 within ``ttft_slo_s``."""
    prompt_tokens = max(1, round(workload.prompt_tokens))
    alone_s = profile.prefill_seconds(prompt_tokens) + profile.pull_seconds(prompt_tokens * profile.kv_bytes_per_token)
    budget_s = ttft_slo_s - alone_s
    if budget_s < 0:
        return 0.0
    mu = prefill_service_rate(profile, prompt_tokens)
    low, high = 0.0, 1.0
    for _ in range(_BISECTION_STEPS):
        rho = (low + high) / 2
        low, high = (rho, high) if wait_p90_s(rho, mu) <= budget_s else (low, rho)
    return low * mu


def decode_step_s(profile: TimingProfile, num_streams: int, context_tokens: int) -> float:
    """One decode step of ``num_streams`` rows, each at ``context_tokens`` of context."""
    return profile.step_seconds([(1, context_tokens)] * num_streams)


def decode_streams(profile: TimingProfile, workload: Workload, itl_slo_s: float) -> int:
    """The most streams one decode instance holds with each step within ``itl_slo_s``."""
    context_tokens = max(1, round(workload.prompt_tokens + workload.output_tokens / 2))
    blocks_per_stream = math.ceil((workload.prompt_tokens + workload.output_tokens) / profile.block_size)
    limit = min(profile.max_num_seqs, profile.num_kv_blocks // blocks_per_stream)
    # The step time grows with the rows: the largest n within the SLO, by bisection.
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if decode_step_s(profile, middle, context_tokens) <= itl_slo_s else (low, middle - 1)
    return low


def poisson_mean_within(num_streams: int) -> float:
    """The largest mean ``L`` with ``L + z90 * sqrt(L) <= num_streams`` (module docstring)."""
    root = (-Z90 + math.sqrt(Z90 * Z90 + 4 * num_streams)) / 2
    return root * root


def decode_capacity(profile: TimingProfile, workload: Workload, itl_slo_s: float) -> tuple[float, int]:
    """(requests a second, streams) one decode instance takes with its ITL within ``itl_slo_s``."""
    num_streams = decode_streams(profile, workload, itl_slo_s)
    if num_streams == 0:
        return 0.0, 0
    mean_streams = poisson_mean_within(num_streams)
    context_tokens = max(1, round(workload.prompt_tokens + workload.output_tokens / 2))
    # Little's law: streams = rate * a stream's seconds (its output tokens at the step time).
    stream_s = workload.output_tokens * decode_step_s(profile, max(1, round(mean_streams)), context_tokens)
    return mean_streams / stream_s, num_streams


def instance_capacity(profile: TimingProfile, workload: Workload, slo: Slo) -> InstanceCapacity:
    """What one prefill and one decode instance each sustain for ``workload`` within ``slo``."""
    decode_rate, num_streams = decode_capacity(profile, workload, slo.itl_s)
    return InstanceCapacity(prefill_capacity(profile, workload, slo.ttft_s), decode_rate, num_streams)


def scaled_profile(profile: TimingProfile, time_scale: float) -> TimingProfile:
    """``profile`` as ``splitserve simulate --time-scale`` runs it: every time multiplied."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0; got {time_scale}")
    return dataclasses.replace(
        profile,
        step_fixed_s=profile.step_fixed_s * time_scale,
        token_s=profile.token_s * time_scale,
        attention_s=profile.attention_s * time_scale,
        context_s=profile.context_s * time_scale,
        pull_fixed_s=profile.pull_fixed_s * time_scale,
        link_bytes_per_s=profile.link_bytes_per_s / time_scale,
        measured_steps=(),
    )
