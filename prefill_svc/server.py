"""``splitserve prefill``: the engine in the prefill role behind gRPC.

Prefill runs the prompt (chunked, with prefix caching), samples the first
token, and leaves the prompt's blocks pinned and published on the KV
connector under a lease. The blocks are freed exactly once: on ReleaseKV, on
Abort, or when the lease expires.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import grpc
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

from engine.outputs import EngineCoreOutput, KVHandoff
from serving.convert import fingerprint_to_proto, logprobs_to_proto
from serving.instance import Instance, add_instance_arguments, serve
from serving.sampling_proto import sampling_params_from_proto

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50061
DEFAULT_LEASE_S = 30.0


class PrefillServicer(disaggregation_pb2_grpc.PrefillServicer):
    def __init__(self, instance: Instance, lease_s: float) -> None:
        self.instance = instance
        self.lease_s = lease_s
        self._leases: dict[str, asyncio.TimerHandle] = {}

    async def Prefill(self, request, context):  # noqa: ANN001, N802 - gRPC signature
        try:
            params = sampling_params_from_proto(request.sampling)
            final: EngineCoreOutput | None = None
            started = time.perf_counter()
            async for output in self.instance.engine.generate(
                list(request.prompt_token_ids),
                params,
                request_id=request.request_id or None,
                priority=request.priority,
                cache_salt=request.cache_salt or None,
            ):
                final = output
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if final is None or not final.new_token_ids:
            await context.abort(grpc.StatusCode.ABORTED, "the request was aborted during prefill")
        response = disaggregation_pb2.PrefillResponse(
            request_id=final.request_id,
            first_token_id=final.new_token_ids[0],
            finish_reason=final.finish_reason or "",
            num_cached_tokens=final.num_cached_tokens,
            prefill_s=time.perf_counter() - started,
        )
        if final.new_logprobs:
            response.first_logprob.CopyFrom(logprobs_to_proto(final.new_logprobs[0]))
        if final.kv_handoff is not None:
            response.kv.CopyFrom(self._pin(final.request_id, final.kv_handoff, list(request.prompt_token_ids)))
        return response

    def _pin(self, request_id: str, handoff: KVHandoff, prompt_token_ids: list[int]) -> disaggregation_pb2.KVHandle:
        """Publish the pinned blocks on the connector and start the lease that frees them."""
        self.instance.connector.publish(request_id, handoff.block_ids, prompt_token_ids)
        loop = asyncio.get_running_loop()
        self._leases[request_id] = loop.call_later(self.lease_s, lambda: asyncio.ensure_future(self._expire(request_id)))
        return disaggregation_pb2.KVHandle(
            prefill_instance_id=self.instance.instance_id,
            connector=self.instance.connector.name,
            connector_address=self.instance.connector_address,
            block_ids=handoff.block_ids,
            num_tokens=handoff.num_tokens,
            block_hashes=[h.to_bytes(16, "little") for h in handoff.block_hashes],
            fingerprint=fingerprint_to_proto(self.instance.fingerprint),
            lease_expires_unix_s=time.time() + self.lease_s,
            prefill_address=self.instance.grpc_address,
            prompt_token_ids=prompt_token_ids,
        )

    async def _unpin(self, request_id: str) -> bool:
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.cancel()
        await self.instance.connector.unpublish(request_id)  # returns once no pull reads the blocks
        return await self.instance.engine.release_kv(request_id)

    async def _expire(self, request_id: str) -> None:
        self._leases.pop(request_id, None)
        if await self._unpin(request_id):
            logger.warning("KV lease of %s expired after %.0f s without a release: blocks freed", request_id, self.lease_s)

    async def ReleaseKV(self, request, context):  # noqa: ANN001, N802
        return disaggregation_pb2.ReleaseKVResponse(released=await self._unpin(request.request_id))

    async def Abort(self, request, context):  # noqa: ANN001, N802
        pinned = await self._unpin(request.request_id)
        await self.instance.engine.abort(request.request_id)  # a prefill still running
        return disaggregation_pb2.AbortResponse(found=pinned)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser, DEFAULT_PORT)
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_S, help="free pinned KV after this long without a release")


def run(args: argparse.Namespace) -> int:
    instance = Instance.create(args, "prefill")
    servicer = PrefillServicer(instance, args.lease_seconds)
    asyncio.run(serve(instance, args, lambda server: disaggregation_pb2_grpc.add_PrefillServicer_to_server(servicer, server)))
    return 0
