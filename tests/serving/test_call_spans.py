"""A colocated instance served in the test's event loop (tiny model, real gRPC): its first
response carries the call's phases, its own histograms count them, and with tracing on its
spans go under the context the caller sent in the call's metadata (an in-memory exporter
stands in for the collector)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.tracing import Tracer
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.checkpoints import VOCAB_SIZE, make_checkpoint
from tests.serving.inprocess import colocated_instance, serving

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"


def test_a_colocated_call_reports_its_phases_and_its_spans_under_the_callers(tmp_path: Path) -> None:
    args, instance = colocated_instance(make_checkpoint(tmp_path))
    exported = InMemorySpanExporter()
    instance.tracer = Tracer("unused", "splitserve-colocated", instance.instance_id, exporter=exported)
    request = generation_pb2.GenerateRequest(
        request_id="r",
        token_ids=generation_pb2.TokenIds(ids=list(range(5, 45))),
        sampling=generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )

    async def scenario() -> list[generation_pb2.GenerateResponse]:
        async with serving(instance, args) as address, grpc.aio.insecure_channel(address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                request, metadata=(("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"),), timeout=60
            )
            return [response async for response in call]

    responses = asyncio.run(scenario())
    phases = responses[0].timings.phases
    assert phases.prefill_compute_s > 0 and phases.prefill_queue_s >= 0 and phases.num_prefill_chunks == 1
    assert phases.kv_publish_s == phases.kv_pull_s == 0  # nothing is handed off
    count = instance.phase_metrics.registry.get_sample_value(
        "splitserve_engine_phase_seconds_count",
        {"instance": instance.instance_id, "role": "colocated", "phase": "prefill_compute"},
    )
    assert count == 1
    spans = {span.name: span for span in exported.get_finished_spans()}
    server = spans["splitserve.v1.Generation/Generate"]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == CALLER_SPAN_ID
    assert server.attributes["gen_ai.usage.output_tokens"] == 4
    for name in ("queue", "prefill chunk"):
        assert spans[name].parent is not None and spans[name].parent.span_id == server.context.span_id
    assert spans["prefill chunk"].attributes["splitserve.chunk.num_tokens"] == 40


def test_a_speculating_call_says_in_its_span_how_many_drafts_were_verified_and_accepted(tmp_path: Path) -> None:
    """n-gram prompt lookup of single tokens on a prompt holding every token of the vocabulary
    (and a few after): whatever the random model samples, it occurs earlier, so the step after it
    verifies drafts; the call's span carries the request's counts, which are the engine's
    (the only request)."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    args, instance = colocated_instance(make_checkpoint(tmp_path), "--speculative-config", spec)
    exported = InMemorySpanExporter()
    instance.tracer = Tracer("unused", "splitserve-colocated", instance.instance_id, exporter=exported)
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=list(range(VOCAB_SIZE)) + list(range(8))),
        sampling=generation_pb2.SamplingParams(max_tokens=12, ignore_eos=True),
    )

    async def scenario() -> None:
        async with serving(instance, args) as address, grpc.aio.insecure_channel(address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
            assert sum([len(response.token_ids) async for response in call]) == 12

    asyncio.run(scenario())
    stats = instance.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    (server,) = [span for span in exported.get_finished_spans() if span.name == "splitserve.v1.Generation/Generate"]
    assert server.attributes["splitserve.spec.num_draft_tokens"] == stats.num_draft_tokens
    assert server.attributes["splitserve.spec.num_accepted_tokens"] == stats.num_accepted_tokens
