"""The phases of a request's time, named once for the gateway, the instances and the header
the gateway answers with (docs/observability.md has what each one covers).

Time to first token is the sum of :data:`TTFT_PHASES`, each measured, none derived from the
others (:func:`ttft_phases`), on the gateway's clock unless said:

- ``gateway_queue``: the gateway's own time, around the call that answered with the first
  token: from the request's arrival to that call's send (gate, tokenizing, routing, failed
  attempts on other instances), and from its answer to the first token written.
- ``prefill_queue``, ``prefill_compute``, ``kv_publish``: the instance that prefilled, on its
  own clock, from the call's arrival there to its answer (``serving/request_timing.py``).
- ``transport``: the hop, measured from both sides of it: the call's round trip as the
  gateway timed it (sent to answered) less the instance's time inside it (its phases): gRPC,
  serialization and the network, both ways. Never negative: an instance reporting more time
  than the call took leaves the sum above the TTFT, which the tests catch.

So the phases add up to the TTFT only when the gateway's and the instance's intervals tile the
request's time, with nothing counted twice or left out. In a disaggregated request the first
token streams once P has answered; :data:`HANDOFF_PHASES`, D's, set the gap before the second token.

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
    arrival: float, call_sent_at: float, answered_at: float, first_token_at: float, instance: RequestPhases | None
) -> RequestPhases:
    """A request's TTFT phases (module docstring), from the gateway's monotonic times: the
    request's arrival, the send and the answer of the call that brought the first token, and
    that token's write; and the instance's own phases of the call (None: it reported none, an
    older instance, and the whole call counts as transport)."""
    phases = RequestPhases(gateway_queue_s=(call_sent_at - arrival) + (first_token_at - answered_at))
    if instance is not None:
        phases.prefill_queue_s = instance.prefill_queue_s
        phases.prefill_compute_s = instance.prefill_compute_s
        phases.kv_publish_s = instance.kv_publish_s
        phases.num_prefill_chunks = instance.num_prefill_chunks
    on_instance = phases.prefill_queue_s + phases.prefill_compute_s + phases.kv_publish_s
    phases.transport_s = max(0.0, answered_at - call_sent_at - on_instance)
    return phases


def add_handoff(phases: RequestPhases, decode: RequestPhases) -> None:
    """D's hand-off phases into a request's."""
    phases.decode_queue_s = decode.decode_queue_s
    phases.kv_pull_s = decode.kv_pull_s
    phases.first_decode_step_s = decode.first_decode_step_s
