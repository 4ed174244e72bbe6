"""``splitserve decode``: the engine in the decode role behind gRPC.

For each request the engine allocates blocks for the prompt, reusing its own
prefix-cache hits, and its KV loader (decode_svc/kv_loader.py) pulls only the
missing blocks from the prefill instance through the KV connector and tells that
instance to release them; the call streams the tokens of the continuous-batching
decode loop.

One Decode call, in call order:

1. ``Decode`` (event loop): check the handle against the call's prompt (P's signature
   over both when this instance has a cluster secret; the token count, fingerprint,
   connector, block count; nothing is allocated for a handle refused here), have the
   loader ``expect`` it (it renews P's lease from now on), and add the request to the
   engine with P's first token and the call's KV-load failure policy.
2. The engine loads the KV itself (engine/kv_loader.py: the scheduler starts the load when
   it has blocks for the prompt, the loader pulls, the scheduler polls the result at a step
   boundary) and the request joins the decode loop.
3. ``Decode`` streams the engine's outputs; the first response carries how the KV came
   (``KVTransfer``, from the loader's ``outcome``) and the call's phases (its wait for blocks,
   the pull, the first step: ``serving/request_timing.py``), which also become this instance's
   histograms and, with tracing on, spans inside the call's span (started in step 1, under the
   gateway's call; the lease keeper adds P's lease renewals to it meanwhile). A request whose
   KV could not be loaded and may not recompute ends with finish reason "error", which the
   call turns into its status (below).
4. The call ends: ``forget`` (P's lease released if still held) and the stream closed, which
   aborts an unfinished request; the engine frees its blocks once no pull writes to them.

An instance that drains by handing its streams over (SIGUSR2, ``serving/instance.py``) ends
each call that ``may_hand_over`` after its next response with one more, ``handed_over``: the
gateway resumes the request on another decode instance after the tokens it has (as it does
when a decode instance dies, ``gateway/failover.py``), and this instance is idle as soon as
its other calls end, not when its longest stream would have.

A call without a KV handle (the gateway's conditional disaggregation: a short prompt, or
one mostly in this instance's prefix cache) skips the load: the engine prefills the prompt
here, in chunks of at most ``--decode-recompute-chunk`` tokens per step beside the running
decodes, and samples the first token itself; the stream starts with that token.

When the pull fails (or P says it no longer holds the KV), D does not recompute
the prompt unless the call allows it (``allow_recompute``, the gateway's last
resort): it ends the call with ``DATA_LOSS`` before any token, so the gateway can
prefill again — on the same P, whose prefix cache still has most of the blocks —
and hand the new KV over. A recompute, when allowed, runs in chunks of at most
``--decode-recompute-chunk`` tokens per step, so running streams keep their pace;
with ``--kv-failure-policy fail`` such a call ends with ``UNAVAILABLE`` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import grpc

from cluster.handle_signing import HandleRejected, verify_handle
from cluster.request_phases import HANDOFF_PHASES, LOCAL_PREFILL_PHASES
from cluster.sampling_proto import sampling_params_from_proto
from cluster.tracing import Tracer
from decode_svc.kv_loader import KVLoadOutcome, RemoteKVLoader
from engine.config import EngineConfig
from engine.kv_loader import KVLoadFailurePolicy
from engine.openmp_threads import serial_openmp
from engine.request_timing import RequestTiming
from kv_connector.base import KVSource, block_count_error
from kv_connector.fingerprint import FingerprintMismatchError
from serving.call_mux import MultiplexedMethod
from serving.convert import kv_source_from_proto, output_to_proto
from serving.instance import Instance, add_instance_arguments, engine_config, serve
from serving.request_timing import CallSpans, handoff_phases, local_phases, spec_decode_attributes
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50071
DEFAULT_RECOMPUTE_CHUNK = 256
KVFailurePolicy = Literal["recompute", "fail"]


class DecodeServicer(disaggregation_pb2_grpc.DecodeServicer):
    def __init__(self, instance: Instance, failure_policy: KVFailurePolicy, kv_loader: RemoteKVLoader) -> None:
        self.instance = instance
        self.kv_loader = kv_loader
        self.failure_policy = failure_policy
        self._calls: set[str] = set()  # request ids of the Decode calls in progress

    async def start(self) -> None:
        """On the serving event loop, once the engine runs and before calls arrive."""
        self.kv_loader.start()

    async def close(self) -> None:
        await self.kv_loader.close()

    # -------------------------------------------------------------- the RPC

    async def Decode(self, request, context):  # noqa: N802 - gRPC signature
        received_at = time.monotonic()
        request_id = request.request_id
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        local = not request.HasField("kv")  # conditional disaggregation: prefill here
        handle = request.kv
        source = None if local else kv_source_from_proto(handle, request.prompt_token_ids, request.cache_salt)
        try:
            params = sampling_params_from_proto(request.sampling)
            if source is not None:
                self._check_handle(handle, source, request.prompt_token_ids)
        except HandleRejected as error:
            self.instance.counters.num_kv_handles_refused += 1
            logger.warning("refused the KV handle of %s (from %r): %s", request_id, handle.connector_address, error)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        except FingerprintMismatchError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if request_id in self._calls:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already decoding here")
        self._calls.add(request_id)
        # With tracing on the call's span starts now, so that the lease keeper can add P's lease
        # renewals to it while the request waits; the spans inside it wait for the first response.
        tracer = self.instance.tracer
        spans = self._call_spans(tracer, request, context, received_at) if tracer is not None else None
        if source is not None:
            self.kv_loader.expect(request_id, source, handle.prefill_address, handle.lease_s, spans)
        else:
            self.instance.counters.num_local_prefills += 1
        policy: KVLoadFailurePolicy = (
            "recompute" if request.allow_recompute and self.failure_policy == "recompute" else "fail"
        )
        stream = self.instance.engine.generate(
            list(request.prompt_token_ids),
            params,
            request_id=request_id,
            priority=request.priority,
            first_token_id=None if local else request.first_token_id,
            cache_salt=request.cache_salt or None,
            kv_load_failure_policy=policy,
            draft_token_ids=None if local else list(handle.draft_token_ids),
        )
        first = True
        num_output_tokens, finish_reason, failure = 0, "", None
        spec_counts = (0, 0)  # the request's drafts verified and accepted, as of its latest output
        try:
            async for output in stream:
                if output.finish_reason == "error":
                    failure = output.error or "the request's KV could not be loaded"
                    if spans is not None and output.timing is not None:  # the wait and the failed pull
                        self._trace_first_output(spans, request, output.timing, self.kv_loader.outcome(request_id))
                    await self._end_without_kv(context, request_id, request.allow_recompute, output.error or "")
                response = output_to_proto(output, disaggregation_pb2.DecodeResponse)
                outcome = None
                if first:
                    outcome = self.kv_loader.outcome(request_id) if source is not None else None
                    if source is not None:
                        response.kv_transfer.CopyFrom(self._transfer(request_id, outcome))
                    else:
                        response.num_cached_tokens = output.num_cached_tokens
                    if output.timing is not None:
                        self._account(request, received_at, output.timing, response)
                num_output_tokens += len(output.new_token_ids)
                finish_reason = output.finish_reason or ""
                spec_counts = (output.num_spec_draft_tokens, output.num_spec_accepted_tokens)
                yield response
                # Spans after the response has gone: off the path to its token.
                if first and output.timing is not None and spans is not None:
                    self._trace_first_output(spans, request, output.timing, outcome)
                first = False
                if spans is not None and output.step is not None:
                    spans.step(output.step)
                if not finish_reason and request.may_hand_over and self.instance.handing_over.is_set():
                    # This instance drains (SIGUSR2): the gateway resumes the request elsewhere
                    # after the tokens sent; closing the stream below aborts it here.
                    self.instance.counters.num_handovers += 1
                    finish_reason = "handed_over"
                    yield disaggregation_pb2.DecodeResponse(request_id=request_id, handed_over=True)
                    return
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            self._calls.discard(request_id)
            self.kv_loader.forget(request_id)  # releases P's blocks unless the pull did
            await stream.aclose()  # aborts the request now if it has not finished
            if spans is not None:
                spans.end(
                    time.monotonic(),
                    {
                        "gen_ai.usage.output_tokens": num_output_tokens,
                        "splitserve.finish_reason": finish_reason,
                        **spec_decode_attributes(*spec_counts),
                    },
                    error=None if finish_reason else failure or "the call ended before the request finished",
                )

    def _account(
        self,
        request: disaggregation_pb2.DecodeRequest,
        received_at: float,
        timing: RequestTiming,
        response: disaggregation_pb2.DecodeResponse,
    ) -> None:
        """The call's phases into its first response and this instance's histograms."""
        handoff = request.HasField("kv")
        phases = handoff_phases(received_at, timing) if handoff else local_phases(received_at, timing)
        response.phases.CopyFrom(phases)
        self.instance.phase_metrics.observe(phases, HANDOFF_PHASES if handoff else LOCAL_PREFILL_PHASES)

    def _call_spans(
        self,
        tracer: Tracer,
        request: disaggregation_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext,
        received_at: float,
    ) -> CallSpans:
        """The call's span, from its arrival, under the gateway's call (it ends with the call)."""
        return CallSpans(
            tracer,
            "splitserve.v1.Decode/Decode",
            context.invocation_metadata(),
            received_at,
            {
                "gen_ai.request.id": request.request_id,
                "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                "splitserve.instance.id": self.instance.instance_id,
                "splitserve.kv_handoff": request.HasField("kv"),
                "splitserve.allow_recompute": request.allow_recompute,
            },
        )

    def _trace_first_output(
        self,
        spans: CallSpans,
        request: disaggregation_pb2.DecodeRequest,
        timing: RequestTiming,
        outcome: KVLoadOutcome | None,
    ) -> None:
        """The spans inside the call's, up to its first token (or up to the failed load that
        ended it without one)."""
        if request.HasField("kv"):
            spans.handoff(timing, outcome, self.kv_loader.connector.name)
        else:
            spans.prompt(timing)

    def _check_handle(
        self, handle: disaggregation_pb2.KVHandle, source: KVSource, prompt_token_ids: Sequence[int]
    ) -> None:
        """Raise HandleRejected (the handle is not one a prefill instance of this cluster issued),
        FingerprintMismatchError or ValueError for a handle this instance cannot pull. Runs
        before anything is allocated: what a refused handle names is never pulled nor cached."""
        # The pulled KV goes into the prefix cache under this call's prompt: it must be that
        # prompt's. P signed the handle over the prompt it computed the KV from.
        if self.instance.plane.secret is not None:
            verify_handle(handle, prompt_token_ids, self.instance.plane.secret.handle_key)
        num_prompt_tokens = len(prompt_token_ids)
        if handle.num_tokens != num_prompt_tokens:
            raise ValueError(
                f"the KV handle holds the KV of {handle.num_tokens} tokens; this call's prompt has {num_prompt_tokens}"
            )
        self.kv_loader.connector.check_pairing(source.fingerprint)  # the fingerprint's rule and the backend's
        connector_name = self.kv_loader.connector.name
        if handle.connector and handle.connector != connector_name:
            raise ValueError(
                f"the KV handle is for the {handle.connector!r} connector; this decode instance uses {connector_name!r}"
            )
        if (
            mismatch := block_count_error(
                len(source.block_ids), num_prompt_tokens, self.instance.fingerprint.block_size
            )
        ) is not None:
            raise ValueError(f"the KV handle does not fit this call's prompt: {mismatch}")

    def _transfer(self, request_id: str, outcome: KVLoadOutcome | None) -> disaggregation_pb2.KVTransfer:
        """How the request's KV came (``outcome``), for its first response: pulled, or recomputed here."""
        if outcome is None:
            raise RuntimeError(f"bug: {request_id} decoded before its KV load ended")
        if outcome.stats is None:
            self.instance.counters.num_kv_recomputes += 1
            return disaggregation_pb2.KVTransfer(num_local_hit_blocks=outcome.num_local_hit_blocks, recomputed=True)
        return disaggregation_pb2.KVTransfer(
            num_pulled_blocks=outcome.stats.num_blocks,
            num_local_hit_blocks=outcome.num_local_hit_blocks,
            num_bytes=outcome.stats.num_bytes,
            seconds=outcome.stats.seconds,
        )

    async def _end_without_kv(
        self, context: grpc.aio.ServicerContext, request_id: str, allow_recompute: bool, reason: str
    ) -> None:
        """The request's KV could not be loaded and it may not recompute here: end the call
        before any token, as a hand-back (prefill it again) unless it was the last resort."""
        if allow_recompute:  # --kv-failure-policy fail
            logger.warning("KV pull for %s failed, failing the request: %s", request_id, reason)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer from the prefill instance failed: {reason}")
        logger.warning("KV of %s cannot be pulled (%s): handing it back for another prefill", request_id, reason)
        self.instance.counters.num_kv_handbacks += 1
        await context.abort(
            grpc.StatusCode.DATA_LOSS, f"the prompt's KV could not be pulled ({reason}); prefill it again"
        )

    async def Abort(self, request, context):  # noqa: N802
        found = request.request_id in self._calls
        self.instance.engine.abort(request.request_id)
        return disaggregation_pb2.AbortResponse(found=found)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser, DEFAULT_PORT)
    parser.add_argument(
        "--kv-failure-policy",
        default="recompute",
        choices=["recompute", "fail"],
        help="when a pull fails on a call that allows recompute (the gateway's last hand-off attempt): "
        "recompute the prompt here, in chunks, or fail the request",
    )
    parser.add_argument("--kv-pull-timeout", type=float, default=10.0, help="seconds before a KV pull counts as failed")
    parser.add_argument(
        "--decode-recompute-chunk",
        type=int,
        default=DEFAULT_RECOMPUTE_CHUNK,
        help="prompt tokens a step computes at most beside its decodes (recomputes, preempted requests), "
        "so running streams wait at most one chunk per step",
    )


def decode_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The decode role's engine settings: a prompt it must compute itself goes in chunks."""
    return dataclasses.replace(engine_config(args, "decode"), max_num_prefill_tokens=args.decode_recompute_chunk)


async def serve_instance(instance: Instance, args: argparse.Namespace, **options: Any) -> None:
    """Serve ``instance`` in the decode role until stopped; ``options`` go to :func:`serve`."""
    servicer = DecodeServicer(instance, args.kv_failure_policy, RemoteKVLoader(instance, args.kv_pull_timeout))
    await serve(
        instance,
        args,
        lambda server: disaggregation_pb2_grpc.add_DecodeServicer_to_server(servicer, server),
        kv_loader=servicer.kv_loader,
        on_start=servicer.start,
        on_stop=servicer.close,
        multiplexed={"decode": MultiplexedMethod("/splitserve.v1.Decode/Decode", servicer.Decode)},
        **options,
    )


def run(args: argparse.Namespace) -> int:
    instance = Instance.create(args, "decode", decode_engine_config(args))
    serial_openmp()  # this thread runs the event loop: no OpenMP team beside the step thread's
    asyncio.run(serve_instance(instance, args))
    return 0
