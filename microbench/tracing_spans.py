"""The CPU one request's trace costs, per request, with the real OpenTelemetry SDK exporting
(in batches, from its own thread) to a port where nothing listens::

    python -m microbench.tracing_spans --requests 300

It builds what the three processes build for one disaggregated request: at the gateway the
root span and two call spans with their ``traceparent`` (before the first token), then the
edge's stage and the root's end; P's call span, queue, one prompt chunk and KV publish; D's
call span, queue, KV pull and first step, and 64 decode steps checked for slow tokens.
``time.thread_time()`` counts this thread's CPU only: the exporter's thread is not in it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import dataclass

from cluster.tracing import Tracer
from engine.request_timing import PromptChunk, RequestTiming, StepStats
from gateway.request_trace import CallTrace, EdgeTiming, RequestTrace
from serving.request_timing import CallSpans, KVPublish
from splitserve.v1.generation_pb2 import RequestPhases

METHODS = ("splitserve.v1.Prefill/Prefill", "splitserve.v1.Decode/Decode")


@dataclass(frozen=True, slots=True)
class FakeInstance:
    """What a call span reads of the gateway's record of an instance."""

    address: str
    instance_id: str


def one_request(tracer: Tracer) -> tuple[float, float]:
    """CPU seconds spent building the request's spans before its first token, and after it."""
    now = time.monotonic()
    started = time.thread_time()
    edge = EdgeTiming(arrived_at=now - 0.01)
    with edge.stage("tokenize"):
        pass
    trace = RequestTrace(tracer, "text_completion m", None, edge, {"gen_ai.operation.name": "text_completion"})
    calls = [CallTrace(trace, method, FakeInstance("127.0.0.1:1", "p-0")) for method in METHODS]  # type: ignore[arg-type]
    first_token = time.thread_time()
    timing = RequestTiming(
        now - 0.009, now - 0.008, now - 0.004, now - 0.003, [PromptChunk(now - 0.008, now - 0.006, 128, 128)]
    )
    timing.first_token_step_started_at, timing.first_token_at = now - 0.002, now - 0.001
    prefill = CallSpans(tracer, METHODS[0], calls[0].metadata, now - 0.009, {"gen_ai.request.id": "r"})
    prefill.prompt(timing)
    prefill.publish(KVPublish(now - 0.006, now - 0.005, 8, "ucx"))
    prefill.end(now)
    decode = CallSpans(tracer, METHODS[1], calls[1].metadata, now - 0.005, {"gen_ai.request.id": "r"})
    decode.handoff(timing, None, "ucx")
    for _ in range(64):
        decode.step(StepStats(now, now, 4, 4, 0, 0, 0))
    decode.end(now)
    for call in calls:
        call.end(None)
    trace.finish(now, "length", {"gen_ai.usage.output_tokens": 64}, now - 0.005, RequestPhases())
    return first_token - started, time.thread_time() - first_token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    tracer = Tracer(f"http://127.0.0.1:{port}", "microbench", "m")
    for _ in range(20):  # warm-up
        one_request(tracer)
    before = after = 0.0
    for _ in range(args.requests):
        on_path, off_path = one_request(tracer)
        before, after = before + on_path, after + off_path
    print(
        f"per request: {before / args.requests * 1e6:.0f} us of CPU before the first token (gateway), "
        f"{after / args.requests * 1e6:.0f} us after it (the three processes' spans together)"
    )
    tracer.shutdown(timeout_s=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
