"""``splitserve decode``: the engine in the decode role behind gRPC.

For each request the engine allocates blocks for the prompt, reusing its own
prefix-cache hits; this service pulls only the missing blocks from the prefill
instance through the KV connector, tells the prefill instance to release them,
and streams the tokens of the continuous-batching decode loop. If the pull
fails or times out, the prompt is recomputed locally (default) or the request
fails with a clear error; other requests never notice.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

import grpc
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

from engine.scheduler_output import KVLoad
from kv_connector.base import KVSource, KVTransferError, TransferStats
from kv_connector.fingerprint import FingerprintMismatchError
from serving.convert import kv_source_from_proto, logprobs_to_proto
from serving.instance import Instance, add_instance_arguments, serve
from serving.sampling_proto import sampling_params_from_proto

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50071
KVFailurePolicy = Literal["recompute", "fail"]


@dataclass(slots=True)
class PendingPull:
    source: KVSource
    prefill_address: str
    task: asyncio.Task[None] | None = None  # the pull, while in flight
    transfer: disaggregation_pb2.KVTransfer | None = None
    error: str = ""


class DecodeServicer(disaggregation_pb2_grpc.DecodeServicer):
    def __init__(self, failure_policy: KVFailurePolicy, pull_timeout_s: float) -> None:
        self.failure_policy = failure_policy
        self.pull_timeout_s = pull_timeout_s
        self.instance: Instance | None = None  # set once the engine exists (it calls back into us)
        self._pending: dict[str, PendingPull] = {}
        # The serving loop, captured by the first Decode call (KV loads only follow Decode calls).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Future[None]] = set()  # strong references to release tasks

    # -------------------------------------------------------------- the RPC

    async def Decode(self, request, context):  # noqa: ANN001, N802 - gRPC signature
        instance = self._instance()
        self._loop = asyncio.get_running_loop()
        source = kv_source_from_proto(request.request_id, request.kv)
        try:
            instance.fingerprint.check_compatible(source.fingerprint, "decode", "prefill")
            params = sampling_params_from_proto(request.sampling)
        except FingerprintMismatchError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        num_blocks = -(-len(request.prompt_token_ids) // instance.fingerprint.block_size)
        if len(source.block_ids) != num_blocks:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the KV handle names {len(source.block_ids)} blocks for a {len(request.prompt_token_ids)}-token prompt ({num_blocks} expected)",
            )
        pending = PendingPull(source, request.kv.prefill_address)
        self._pending[request.request_id] = pending
        first_response = True
        stream = instance.engine.generate(
            list(request.prompt_token_ids),
            params,
            request_id=request.request_id,
            priority=request.priority,
            first_token_id=request.first_token_id,
            cache_salt=request.cache_salt or None,
        )
        try:
            async for output in stream:
                if output.finish_reason == "abort" and pending.error:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, pending.error)
                response = disaggregation_pb2.DecodeResponse(
                    request_id=output.request_id,
                    token_ids=output.new_token_ids,
                    logprobs=[logprobs_to_proto(lp) for lp in output.new_logprobs],
                    finish_reason=output.finish_reason or "",
                )
                if isinstance(output.stop_reason, int):
                    response.stop_token_id = output.stop_reason
                if first_response and pending.transfer is not None:
                    response.kv_transfer.CopyFrom(pending.transfer)
                    first_response = False
                yield response
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            self._pending.pop(request.request_id, None)
            # A pull still in flight writes into this request's blocks when it lands: stop it
            # before the engine may free (and hand out) those blocks.
            if pending.task is not None and not pending.task.done():
                pending.task.cancel()
                await asyncio.gather(pending.task, return_exceptions=True)
            await stream.aclose()  # aborts the request now if it has not finished

    async def Abort(self, request, context):  # noqa: ANN001, N802
        found = request.request_id in self._pending
        await self._instance().engine.abort(request.request_id)
        return disaggregation_pb2.AbortResponse(found=found)

    # ------------------------------------------------------------ KV pulls

    def on_kv_loads(self, loads: list[KVLoad]) -> None:
        """Engine thread: blocks are allocated for these prompts; start their pulls on the event loop."""
        if self._loop is None:
            raise RuntimeError("KV loads before any Decode call (bug)")
        for load in loads:
            self._loop.call_soon_threadsafe(self._start_pull, load)

    def _start_pull(self, load: KVLoad) -> None:
        pending = self._pending.get(load.request_id)
        if pending is None:
            return  # the client left before the pull started; the engine frees the blocks
        pending.task = asyncio.ensure_future(self._pull(load, pending))

    async def _pull(self, load: KVLoad, pending: PendingPull) -> None:
        instance = self._instance()
        first_block = load.num_local_hit_tokens // instance.fingerprint.block_size
        try:
            stats = await instance.connector.pull(pending.source, load.block_ids, first_block, self.pull_timeout_s)
        except KVTransferError as error:
            await self._pull_failed(load, pending, str(error))
        else:
            instance.transfers.add(stats)
            pending.transfer = _transfer_proto(stats, first_block, recomputed=False)
            instance.engine.finish_kv_load(load.request_id, success=True)
            logger.info(
                "pulled %d blocks (%d bytes, %d messages) for %s in %.4f s",
                stats.num_blocks, stats.num_bytes, stats.num_messages, load.request_id, stats.seconds,
            )
        # Not awaited: the release must reach P even if this request ends (and cancels its pull) first.
        release = asyncio.ensure_future(self._release_on_prefill(pending))
        self._background.add(release)
        release.add_done_callback(self._background.discard)

    async def _pull_failed(self, load: KVLoad, pending: PendingPull, reason: str) -> None:
        instance = self._instance()
        if self.failure_policy == "fail":
            logger.warning("KV pull for %s failed, failing the request: %s", load.request_id, reason)
            pending.error = f"KV transfer from the prefill instance failed: {reason}"
            await instance.engine.abort(load.request_id)
            return
        logger.warning("KV pull for %s failed, recomputing the prompt locally: %s", load.request_id, reason)
        first_block = load.num_local_hit_tokens // instance.fingerprint.block_size
        pending.transfer = _transfer_proto(TransferStats(0, 0, 0.0), first_block, recomputed=True)
        instance.engine.finish_kv_load(load.request_id, success=False)

    async def _release_on_prefill(self, pending: PendingPull) -> None:
        """Tell P it may free the blocks; P's lease frees them anyway if it never hears."""
        if not pending.prefill_address:
            return
        try:
            channel = self._channels.get(pending.prefill_address)
            if channel is None:
                channel = self._channels[pending.prefill_address] = grpc.aio.insecure_channel(pending.prefill_address)
            stub = disaggregation_pb2_grpc.PrefillStub(channel)
            await stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id=pending.source.request_id), timeout=5.0)
        except grpc.aio.AioRpcError as error:
            logger.info("ReleaseKV to %s failed (%s); its lease will free the blocks", pending.prefill_address, error.code())

    def _instance(self) -> Instance:
        if self.instance is None:
            raise RuntimeError("DecodeServicer used before its instance was attached (bug)")
        return self.instance

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


def _transfer_proto(stats: TransferStats, first_block: int, recomputed: bool) -> disaggregation_pb2.KVTransfer:
    return disaggregation_pb2.KVTransfer(
        num_pulled_blocks=stats.num_blocks,
        num_local_hit_blocks=first_block,
        num_bytes=stats.num_bytes,
        seconds=stats.seconds,
        recomputed=recomputed,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser, DEFAULT_PORT)
    parser.add_argument("--kv-failure-policy", default="recompute", choices=["recompute", "fail"],
                        help="when a KV pull fails: recompute the prompt locally, or fail the request")
    parser.add_argument("--kv-pull-timeout", type=float, default=10.0, help="seconds before a KV pull counts as failed")


def run(args: argparse.Namespace) -> int:
    servicer = DecodeServicer(args.kv_failure_policy, args.kv_pull_timeout)
    instance = Instance.create(args, "decode", on_kv_loads=servicer.on_kv_loads)
    servicer.instance = instance

    async def main() -> None:
        try:
            await serve(instance, args, lambda server: disaggregation_pb2_grpc.add_DecodeServicer_to_server(servicer, server))
        finally:
            await servicer.close()

    asyncio.run(main())
    return 0
