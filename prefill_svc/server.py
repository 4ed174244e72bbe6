"""``splitserve prefill``: the engine in the prefill role behind gRPC.

Prefill runs the prompt (chunked, with prefix caching), samples the first
token, and leaves the prompt's blocks pinned and published on the KV
connector under a lease. The KV handle it returns carries a fresh pull token
(pulls must present it) and, with a cluster secret, P's signature
(``cluster/handle_signing.py``). The blocks are freed exactly once: on ReleaseKV, on
Abort, or when the lease expires; a decode instance holding the handle renews
the lease (RenewKV) while the request waits there, so the lease only expires
when that instance is gone or silent. :class:`~prefill_svc.leases.KVLeases` keeps
that record and frees the blocks.

Control calls never wait for an engine step (a prefill step of a long prompt
takes seconds on a CPU): ReleaseKV, RenewKV and Abort change the leases' record
of what is pinned and answer at once; freeing runs in the background. Nor do they wait
for a publish: the connector's publish (with the lmcache connector, storing the KV and
waiting for the store to confirm it, seconds when the store is slow) runs off the event
loop while the Prefill call awaits it (``prefill_svc/leases.py``).

Each answer carries the call's phases (its queue, its prompt's computation, the publish:
``serving/request_timing.py``), which the gateway adds into the request's TTFT; with tracing
on, the call's spans go under the gateway's call span, whose context came in its metadata.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import grpc

from cluster.handle_signing import new_pull_token, sign_handle
from cluster.internal_grpc import abort_call
from cluster.request_phases import PREFILL_CALL_PHASES
from cluster.sampling_proto import sampling_params_from_proto
from engine.openmp_threads import serial_openmp
from engine.outputs import EngineCoreOutput, KVHandoff
from engine.request_timing import RequestTiming
from engine.sampling_params import SamplingParams
from kv_connector.draft_kv import DraftKVCarrier
from prefill_svc.leases import KVLeases
from serving.convert import fingerprint_to_proto, logprobs_to_proto
from serving.instance import Instance, add_instance_arguments, serve
from serving.request_timing import CallSpans, KVPublish, prefill_phases
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

DEFAULT_PORT = 50061
DEFAULT_LEASE_S = 30.0
RELEASE_GRACE_S = 5.0  # how long a released request's pull may still take to finish sending


def kv_only_params() -> SamplingParams:
    """A re-prefill (``kv_only``) needs the prompt's KV, not a token: sample greedily and
    never finish on that token, so the blocks are always pinned and handed off."""
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


class PrefillServicer(disaggregation_pb2_grpc.PrefillServicer):
    def __init__(self, instance: Instance, lease_s: float) -> None:
        if instance.connector is None:
            raise ValueError("a prefill instance needs a KV connector")
        self.instance = instance
        self.connector = instance.connector
        self.leases = KVLeases(instance.connector, instance.engine, lease_s, instance.counters)
        self._prefilling: dict[str, bool] = {}  # Prefill calls in progress -> aborted meanwhile

    async def Prefill(self, request, context):  # noqa: N802 - gRPC signature
        received_at = time.monotonic()
        request_id = request.request_id
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if request_id in self._prefilling or request_id in self.leases:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already prefilling or pinned here"
            )
        self._prefilling[request_id] = False
        final: EngineCoreOutput | None = None
        try:
            params = kv_only_params() if request.kv_only else sampling_params_from_proto(request.sampling)
            async for output in self.instance.engine.generate(
                list(request.prompt_token_ids),
                params,
                request_id=request_id,
                priority=request.priority,
                cache_salt=request.cache_salt or None,
            ):
                final = output
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            aborted = self._prefilling.pop(request_id)
        if final is None or not final.new_token_ids or aborted:
            # Aborted while prefilling: the engine frees whatever the request held.
            await abort_call(context, grpc.StatusCode.ABORTED, "the request was aborted during prefill")
        response = disaggregation_pb2.PrefillResponse(
            request_id=final.request_id,
            first_token_id=final.new_token_ids[0],
            finish_reason=final.finish_reason or "",
            num_cached_tokens=final.num_cached_tokens,
        )
        if final.new_logprobs:
            response.first_logprob.CopyFrom(logprobs_to_proto(final.new_logprobs[0]))
        publish = None
        if final.kv_handoff is not None:
            publish_started_at = time.monotonic()
            handle = await self._pin(request_id, final.kv_handoff, list(request.prompt_token_ids), request.cache_salt)
            if handle is None:
                await abort_call(context, grpc.StatusCode.ABORTED, "the request was aborted while its KV was published")
            response.kv.CopyFrom(handle)
            publish = KVPublish(publish_started_at, time.monotonic(), len(handle.block_ids), self.connector.name)
        if final.timing is not None:
            self._account(request, context, received_at, final.timing, publish, response)
        return response

    def _account(
        self,
        request: disaggregation_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
        received_at: float,
        timing: RequestTiming,
        publish: KVPublish | None,
        response: disaggregation_pb2.PrefillResponse,
    ) -> None:
        """The call's phases into its answer and this instance's histograms; with tracing on,
        its spans, built once the answer has gone (off the path to the first token)."""
        answered_at = time.monotonic()
        response.phases.CopyFrom(prefill_phases(received_at, timing, answered_at))
        self.instance.phase_metrics.observe(response.phases, PREFILL_CALL_PHASES)
        tracer = self.instance.tracer
        if tracer is None:
            return
        attributes: dict[str, str | bool | int | float] = {
            "gen_ai.request.id": request.request_id,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "splitserve.num_cached_tokens": response.num_cached_tokens,
            "splitserve.kv_only": request.kv_only,
            "splitserve.instance.id": self.instance.instance_id,
            # vLLM's names for the same spans of time
            "gen_ai.latency.time_in_queue": response.phases.prefill_queue_s,
            "gen_ai.latency.time_in_model_prefill": response.phases.prefill_compute_s,
        }
        metadata = context.invocation_metadata()

        def record() -> None:
            spans = CallSpans(tracer, "splitserve.v1.Prefill/Prefill", metadata, received_at, attributes)
            spans.prompt(timing)
            if publish is not None:
                spans.publish(publish)
            spans.end(answered_at)

        asyncio.get_running_loop().call_soon(record)

    async def _pin(
        self, request_id: str, handoff: KVHandoff, prompt_token_ids: list[int], cache_salt: str
    ) -> disaggregation_pb2.KVHandle | None:
        """Start the lease that frees the pinned blocks, publish them on the connector under a
        fresh pull token (off the event loop), and return the handle, signed when the instance
        has a cluster secret; None when the request was aborted or released meanwhile."""
        pull_token = new_pull_token()
        published = await self.leases.pin(request_id, handoff.block_ids, prompt_token_ids, pull_token, cache_salt)
        if published is None:
            return None
        draft_kv_digest = b""
        if handoff.prompt_draft_kv is not None and isinstance(self.connector, DraftKVCarrier):
            # Before the handle goes out, so every pull finds it (kv_connector/draft_kv.py).
            draft_kv_digest = await self.connector.publish_draft_kv(
                request_id, handoff.prompt_draft_kv, pull_token, cache_salt
            )
            if request_id not in self.leases:
                return None  # aborted while a store took the draft KV
        handle = disaggregation_pb2.KVHandle(
            request_id=request_id,
            connector=self.connector.name,
            connector_address=self.instance.connector_address,
            block_ids=handoff.block_ids,
            num_tokens=handoff.num_tokens,
            fingerprint=fingerprint_to_proto(self.instance.fingerprint),
            lease_s=self.leases.lease_s,
            prefill_address=self.instance.grpc_address,
            pull_token=pull_token,
            chunk_digests=published.chunk_digests,
            rank_connector_addresses=self.instance.connector_rank_addresses,
            draft_token_ids=handoff.draft_token_ids,
            draft_kv_digest=draft_kv_digest,
        )
        if self.instance.plane.secret is not None:
            sign_handle(handle, prompt_token_ids, self.instance.plane.secret.handle_key)
        return handle

    # ------------------------------------------------------ control calls

    async def ReleaseKV(self, request, context):  # noqa: N802
        # D releases once its pull is over: a send P has not yet seen complete is finishing.
        return disaggregation_pb2.ReleaseKVResponse(released=self.leases.unpin(request.request_id, RELEASE_GRACE_S))

    async def RenewKV(self, request, context):  # noqa: N802
        return disaggregation_pb2.RenewKVResponse(unknown_request_ids=self.leases.renew(request.request_ids))

    async def Abort(self, request, context):  # noqa: N802
        request_id = request.request_id
        prefilling = request_id in self._prefilling
        if prefilling:
            self._prefilling[request_id] = True  # its Prefill call must not pin what the engine frees
            self.instance.engine.abort(request_id)
        pinned = self.leases.unpin(request_id, grace_s=0.0)
        return disaggregation_pb2.AbortResponse(found=prefilling or pinned)

    async def close(self) -> None:
        """At shutdown: free what is still pinned, and wait for frees under way."""
        await self.leases.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser, DEFAULT_PORT)
    parser.add_argument(
        "--lease-seconds",
        type=float,
        default=DEFAULT_LEASE_S,
        help="free pinned KV after this long without a release or a renewal from the decode instance",
    )


async def serve_instance(instance: Instance, args: argparse.Namespace, **options: Any) -> None:
    """Serve ``instance`` in the prefill role until stopped; ``options`` go to :func:`serve`."""
    servicer = PrefillServicer(instance, args.lease_seconds)
    await serve(
        instance,
        args,
        lambda server: disaggregation_pb2_grpc.add_PrefillServicer_to_server(servicer, server),
        on_stop=servicer.close,
        **options,
    )


def run(args: argparse.Namespace) -> int:
    instance = Instance.create(args, "prefill")
    serial_openmp()  # this thread runs the event loop: no OpenMP team beside the step thread's
    asyncio.run(serve_instance(instance, args))
    return 0
