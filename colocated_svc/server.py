"""``splitserve colocated``: the engine doing both phases behind gRPC, with no KV
hand-off. It serves the public ``Generation.Generate`` API for token-id prompts
(tokens in, tokens out: text stays with the gateway), so a gateway can route to
it with ``--colocated HOST:PORT``. This is the baseline disaggregation is
measured against: prefills and decodes share each engine step.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import grpc

from cluster.request_phases import LOCAL_PREFILL_PHASES
from cluster.sampling_proto import sampling_params_from_proto
from cluster.tracing import Tracer
from engine.openmp_threads import serial_openmp
from engine.request_timing import RequestTiming
from serving.call_mux import MultiplexedMethod
from serving.convert import output_to_proto
from serving.instance import Instance, add_instance_arguments, serve
from serving.request_timing import CallSpans, local_phases, spec_decode_attributes
from splitserve.v1 import generation_pb2, generation_pb2_grpc

DEFAULT_PORT = 50081


class ColocatedServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, instance: Instance) -> None:
        self.instance = instance

    async def Generate(self, request, context):  # noqa: N802 - gRPC signature
        if request.WhichOneof("prompt") != "token_ids":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "this instance takes token ids; send text through the gateway"
            )
        prompt = list(request.token_ids.ids)
        arrival = time.monotonic()
        num_completion = 0
        first_token_at: float | None = None
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        stream = self.instance.engine.generate(
            prompt,
            params,
            request_id=request.request_id or None,
            priority=request.priority,
            cache_salt=request.cache_salt or None,
        )
        spans: CallSpans | None = None
        spec_counts = (0, 0)  # the request's drafts verified and accepted, as of its latest output
        try:
            async for output in stream:
                num_completion += len(output.new_token_ids)
                spec_counts = (output.num_spec_draft_tokens, output.num_spec_accepted_tokens)
                response = output_to_proto(output, generation_pb2.GenerateResponse)
                first = first_token_at is None and bool(output.new_token_ids)
                if first:
                    first_token_at = time.monotonic()
                    if output.timing is not None:
                        self._account(arrival, output.timing, response)
                response.usage.CopyFrom(
                    generation_pb2.Usage(
                        prompt_tokens=len(prompt),
                        completion_tokens=num_completion,
                        cached_tokens=output.num_cached_tokens,
                    )
                )
                if output.finished:
                    now = time.monotonic()
                    response.timings.ttft_s = (first_token_at or now) - arrival
                    response.timings.e2e_s = now - arrival
                yield response
                # Spans after the response has gone: off the path to its token.
                if first and output.timing is not None and self.instance.tracer is not None:
                    spans = self._trace(self.instance.tracer, request, context, arrival, output.timing)
                if spans is not None and output.step is not None:
                    spans.step(output.step)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            await stream.aclose()  # a client that left aborts the request and frees its blocks now
            if spans is not None:
                spans.end(
                    time.monotonic(),
                    {"gen_ai.usage.output_tokens": num_completion, **spec_decode_attributes(*spec_counts)},
                )

    def _account(self, arrival: float, timing: RequestTiming, response: generation_pb2.GenerateResponse) -> None:
        """The call's phases into its first response with tokens and this instance's histograms."""
        response.timings.phases.CopyFrom(local_phases(arrival, timing))
        self.instance.phase_metrics.observe(response.timings.phases, LOCAL_PREFILL_PHASES)

    def _trace(
        self,
        tracer: Tracer,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        arrival: float,
        timing: RequestTiming,
    ) -> CallSpans:
        """The call's spans up to its first token (the call's own span ends with the call)."""
        spans = CallSpans(
            tracer,
            "splitserve.v1.Generation/Generate",
            context.invocation_metadata(),
            arrival,
            {
                "gen_ai.request.id": request.request_id,
                "gen_ai.usage.input_tokens": len(request.token_ids.ids),
                "splitserve.instance.id": self.instance.instance_id,
            },
        )
        spans.prompt(timing)
        return spans


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser, DEFAULT_PORT)


async def serve_instance(instance: Instance, args: argparse.Namespace, **options: Any) -> None:
    """Serve ``instance`` doing both phases until stopped; ``options`` go to :func:`serve`."""
    servicer = ColocatedServicer(instance)
    await serve(
        instance,
        args,
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        multiplexed={"generate": MultiplexedMethod("/splitserve.v1.Generation/Generate", servicer.Generate)},
        **options,
    )


def run(args: argparse.Namespace) -> int:
    instance = Instance.create(args, "colocated")
    serial_openmp()  # this thread runs the event loop: no OpenMP team beside the step thread's
    asyncio.run(serve_instance(instance, args))
    return 0
