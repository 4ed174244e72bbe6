"""What the gateway says about each request it served: one log line when it ends
(``--request-log text|json``), the ``x-splitserve-timing`` header of its response, and the
attributes of its trace's root span, all from one :class:`FinishedRequest` record.

The log line goes to the ``gateway.request_log`` logger at INFO: as ``key=value`` pairs
(``text``) or one JSON object (``json``, for a log pipeline), with the request's id, its trace
id (with tracing on), its outcome, its tokens, its time to first token and end-to-end latency,
and the phases of its TTFT and hand-off (``cluster/request_phases.py``).

The header, on every completion (streamed ones too: a stream's headers go out with its first
token, ``gateway/openai_common.first_then_rest``), is ``name=seconds`` pairs separated by
commas: ``ttft`` and the TTFT phases, then on a response that waited for the last token
``e2e`` and the hand-off phases.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from cluster.request_phases import HANDOFF_PHASES, TTFT_PHASES, phase_seconds
from cluster.tracing import Attributes
from engine.sampling_params import SamplingParams
from gateway.flags import RequestLogFormat
from splitserve.v1.generation_pb2 import RequestPhases

logger = logging.getLogger(__name__)

GenAIOperation = Literal["chat", "text_completion"]  # OpenTelemetry's gen_ai.operation.name values
TIMING_HEADER = "x-splitserve-timing"


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request_id: str
    trace_id: str | None  # None when tracing is off
    outcome: str  # "stop", "length", "abort", "error_NNN"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None  # None when no token went out
    e2e_s: float
    kv_transfer_s: float
    phases: RequestPhases | None  # None when no token went out

    def as_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "outcome": self.outcome,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": _rounded(self.ttft_s),
            "e2e_s": _rounded(self.e2e_s),
            "kv_transfer_s": _rounded(self.kv_transfer_s),
        }
        if self.phases is not None:
            record["phases"] = {
                phase: _rounded(phase_seconds(self.phases, phase)) for phase in TTFT_PHASES + HANDOFF_PHASES
            }
        return record


def log_finished(log_format: RequestLogFormat, record: FinishedRequest) -> None:
    if log_format == "off" or not logger.isEnabledFor(logging.INFO):
        return
    fields = record.as_dict()
    if log_format == "json":
        logger.info("%s", json.dumps(fields, separators=(",", ":")))
        return
    phases = fields.pop("phases", {})
    text = " ".join(f"{key}={value}" for key, value in (fields | phases).items() if value is not None)
    logger.info("finished %s", text)


def timing_header(ttft_s: float, phases: RequestPhases, e2e_s: float | None = None) -> str:
    """The ``x-splitserve-timing`` value; ``e2e_s`` (and the hand-off phases) once the request ended."""
    pairs = [("ttft", ttft_s)] + [(phase, phase_seconds(phases, phase)) for phase in TTFT_PHASES]
    if e2e_s is not None:
        pairs += [("e2e", e2e_s)] + [(phase, phase_seconds(phases, phase)) for phase in HANDOFF_PHASES]
    return ", ".join(f"{name}={seconds:.6f}" for name, seconds in pairs)


def request_attributes(
    operation: GenAIOperation, model: str, request_id: str, num_prompt_tokens: int, params: SamplingParams
) -> Attributes:
    """A request's root span's attributes at its start: OpenTelemetry's GenAI names."""
    attributes: dict[str, str | int | float] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.response.id": request_id,
        "gen_ai.request.id": request_id,  # vLLM's name for it
        "gen_ai.usage.input_tokens": num_prompt_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    if params.top_k:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    return attributes


def finish_attributes(record: FinishedRequest) -> Attributes:
    """A request's root span's attributes at its end."""
    attributes: dict[str, str | int | float | list[str]] = {
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "gen_ai.response.finish_reasons": [record.outcome],
        "gen_ai.latency.e2e": record.e2e_s,
        "splitserve.cached_tokens": record.cached_tokens,
    }
    if record.kv_transfer_s:
        attributes["splitserve.kv_transfer_s"] = record.kv_transfer_s
    return attributes


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
