"""The public gRPC ``Generation.Generate`` API, served by the gateway with the same
semantics as the REST path: text or token-id prompts, tokens streamed as they
come (text deltas when the prompt was text), usage and timings at the end.

The caller's ``request_id`` is only echoed back: the request runs under an id the
gateway makes, so two callers that pick the same id never meet on an instance.
A failure nobody expected ends the call with INTERNAL and a message, not a reset.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.health_watch import BoundedHealthServicer
from cluster.sampling_proto import sampling_params_from_proto
from cluster.tls import TLSFiles
from engine.context_length import ContextLengthExceeded, resolve_max_tokens
from gateway.errors import APIError, bad_request, bearer_matches, internal_error, unknown_model
from gateway.gate import GatePass, client_of_peer
from gateway.generation import GenerationJob, GenerationService
from gateway.protocol import MAX_CACHE_SALT_CHARS
from gateway.request_trace import caller_trace_headers
from splitserve.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, service: GenerationService, model_name: str, api_key: str | None) -> None:
        self.service = service
        self.model_name = model_name
        self.api_key = api_key

    async def Generate(self, request, context):  # noqa: N802 - gRPC signature
        gate_pass = None
        try:
            # The gate's order (gateway/gate.py): the key, a slot, then the costly work.
            self._authorize(context)
            gate_pass = self.service.slots.admit(client_of_peer(context.peer()))
            if request.model and request.model != self.model_name:
                raise unknown_model(request.model, self.model_name)
            job = await self._job(request, gate_pass, context)
            async for response in self._responses(request, job):
                yield response
        except APIError as error:
            if gate_pass is None:  # refused at the gate: counted as the REST gate counts
                self.service.metrics.requests.labels(status=f"error_{error.status.value}").inc()
            await context.abort(error.grpc_code, error.message)
        except Exception:
            logger.exception("Generate failed")
            internal = internal_error("while generating")
            await context.abort(internal.grpc_code, internal.message)
        finally:
            if gate_pass is not None:
                gate_pass.release()

    async def _responses(
        self, request: generation_pb2.GenerateRequest, job: GenerationJob
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        request_id = request.request_id or job.request_id
        is_text = request.WhichOneof("prompt") == "text"
        first_token_at: float | None = None
        async with aclosing(self.service.stream(job)) as stream:
            async for delta in stream:
                response = generation_pb2.GenerateResponse(
                    request_id=request_id,
                    token_ids=delta.token_ids,
                    text=delta.text if is_text else "",
                    logprobs=delta.logprobs,
                    finish_reason=delta.finish_reason or "",
                )
                if first_token_at is None:
                    first_token_at = time.monotonic()
                if isinstance(delta.stop_reason, int):
                    response.stop_token_id = delta.stop_reason
                elif isinstance(delta.stop_reason, str):
                    response.stop_string = delta.stop_reason
                if delta.finish_reason is not None:
                    response.usage.CopyFrom(
                        generation_pb2.Usage(
                            prompt_tokens=job.usage.prompt_tokens,
                            completion_tokens=job.usage.completion_tokens,
                            cached_tokens=job.usage.cached_tokens,
                        )
                    )
                    timer = job.timer
                    response.timings.CopyFrom(
                        generation_pb2.Timings(
                            queue_s=(timer.dispatched_at or timer.arrival) - timer.arrival,
                            ttft_s=first_token_at - timer.arrival,
                            kv_transfer_s=job.kv_transfer_s,
                            e2e_s=time.monotonic() - timer.arrival,
                            phases=timer.phases,
                        )
                    )
                yield response

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        if not bearer_matches(str(metadata.get("authorization", "")), self.api_key):
            raise APIError(
                HTTPStatus.UNAUTHORIZED, "invalid or missing API key; send metadata 'authorization: Bearer <key>'"
            )

    async def _job(
        self, request: generation_pb2.GenerateRequest, gate_pass: GatePass, context: grpc.aio.ServicerContext
    ) -> GenerationJob:
        client = gate_pass.client
        try:
            params = sampling_params_from_proto(request.sampling)
        except ValueError as error:
            raise bad_request(str(error)) from error
        if params.structured is not None:
            with gate_pass.timing.stage("grammar compile"):
                await self.service.grammars.check(
                    params.structured, f"sampling.{request.sampling.WhichOneof('structured')}", client
                )
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise bad_request(
                f"cache_salt has {len(request.cache_salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}",
                "cache_salt",
            )
        if request.WhichOneof("prompt") == "text":
            with gate_pass.timing.stage("tokenize"):
                token_ids = await self.service.tokenizer.encode(request.text, client=client, param="text")
        else:
            # The context's first rule before the ids become a Python list on the event loop: a
            # message of --max-request-body-bytes holds millions, a Python object each.
            try:
                resolve_max_tokens(len(request.token_ids.ids), None, self.service.max_model_len)
            except ContextLengthExceeded as error:
                raise bad_request(str(error), "token_ids", code="context_length_exceeded") from None
            token_ids = list(request.token_ids.ids)
        # Token-id prompts get no text back, but stop strings still need the text to match on.
        return self.service.prepare(
            token_ids,
            params,
            priority=request.priority,
            cache_salt=request.cache_salt or None,
            edge=gate_pass.timing,
            caller_trace=caller_trace_headers(dict(context.invocation_metadata() or ())),
        )


@dataclass(frozen=True, slots=True)
class GrpcFront:
    server: grpc.aio.Server
    port: int
    health: BoundedHealthServicer

    async def stop(self, grace: float | None) -> None:
        """Stop taking calls and drain those running for up to ``grace`` seconds. Health
        watchers are told NOT_SERVING and their streams end first: they stay open for as long
        as their clients like, and the drain would wait on them to the end of its grace."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_grpc_front(
    service: GenerationService,
    model_name: str,
    api_key: str | None,
    host: str,
    port: int,
    max_concurrent_rpcs: int | None = None,
    tls: TLSFiles | None = None,
) -> GrpcFront:
    """``max_concurrent_rpcs``: calls served at once (``--max-connections``); gRPC answers
    RESOURCE_EXHAUSTED beyond it before the handler runs. ``tls``: serve TLS with these files
    (``--grpc-tls-*``; with a CA, clients must present a certificate it signed); None: plaintext."""
    # The REST body limit applies to gRPC messages too (gRPC answers RESOURCE_EXHAUSTED beyond it).
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", service.limits.max_body_bytes)],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service, model_name, api_key), server)
    health_servicer = BoundedHealthServicer()  # open to all: its Watch streams capped
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return GrpcFront(server, bound, health_servicer)
