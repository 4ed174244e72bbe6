"""The phases of a request's time, named once for the gateway, the instances and the header
the gateway answers with (docs/observability.md has what each one covers).

Time to first token is the sum of :data:`TTFT_PHASES`, exactly: the instance that prefilled
reports its own three (``serving/request_timing.py``) and the gateway adds its queue and the
rest, ``transport`` (:func:`ttft_phases`). In a disaggregated request the first token streams
once P has answered; :data:`HANDOFF_PHASES`, D's, set the gap before the second token.

Light on purpose (the generated protobuf only): the gateway and every instance import it.
"""

from __future__ import annotations

from typing import Literal

from splitserve.v1.generation_pb2 import RequestPhases

Phase = Literal[
    "gateway_queue",
    "prefill_queue",
    "prefill_compute",
    "kv_publish",
    "transport",
    "decode_queue",
    "kv_pull",
    "first_decode_step",
]
TTFT_PHASES: tuple[Phase, ...] = ("gateway_queue", "prefill_queue", "prefill_compute", "kv_publish", "transport")
HANDOFF_PHASES: tuple[Phase, ...] = ("decode_queue", "kv_pull", "first_decode_step")
# What each kind of call reports (an instance observes these in its own histograms).
PREFILL_CALL_PHASES: tuple[Phase, ...] = ("prefill_queue", "prefill_compute", "kv_publish")
LOCAL_PREFILL_PHASES: tuple[Phase, ...] = ("prefill_queue", "prefill_compute")
# Seconds: a millisecond's queue to a long prompt on a CPU.
PHASE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.15,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)


def phase_seconds(phases: RequestPhases, phase: Phase) -> float:
    value: float = getattr(phases, f"{phase}_s")
    return value


def ttft_phases(
    arrival: float, dispatched_at: float, first_token_at: float, instance: RequestPhases | None
) -> RequestPhases:
    """A request's TTFT phases (gateway clock, monotonic seconds): the gateway's queue up to
    dispatch, the prefilling instance's own phases (None: it reported none, an older instance),
    and ``transport``, the rest, so that they add up to ``first_token_at - arrival``."""
    phases = RequestPhases(gateway_queue_s=dispatched_at - arrival)
    if instance is not None:
        phases.prefill_queue_s = instance.prefill_queue_s
        phases.prefill_compute_s = instance.prefill_compute_s
        phases.kv_publish_s = instance.kv_publish_s
        phases.num_prefill_chunks = instance.num_prefill_chunks
    on_instance = phases.prefill_queue_s + phases.prefill_compute_s + phases.kv_publish_s
    # Instances' clocks run at the host's rate: their time fits in the gateway's call. Clamped
    # anyway, so that a transport phase is never negative (the sum is then off by the clamp).
    phases.transport_s = max(0.0, first_token_at - dispatched_at - on_instance)
    return phases


def add_handoff(phases: RequestPhases, decode: RequestPhases) -> None:
    """D's hand-off phases into a request's."""
    phases.decode_queue_s = decode.decode_queue_s
    phases.kv_pull_s = decode.kv_pull_s
    phases.first_decode_step_s = decode.first_decode_step_s
