"""``splitserve decode``: the engine in the decode role behind gRPC.

For each request the engine allocates blocks for the prompt, reusing its own
prefix-cache hits; this service pulls only the missing blocks from the prefill
instance through the KV connector, tells the prefill instance to release them,
and streams the tokens of the continuous-batching decode loop.

One Decode call, in call order:

1. ``Decode`` (event loop): check the handle against the call's prompt (P's signature
   over both when this instance has a cluster secret; the token count, fingerprint,
   connector, block count; nothing is allocated for a handle refused here), hold it
   (:class:`~decode_svc.leases.LeaseKeeper` renews P's lease from now on), and add the
   request to the engine with P's first token.
2. Engine thread: the scheduler admits the request when it has blocks for the
   prompt and emits a ``KVLoad``: the request's blocks and ``num_local_hit_blocks``,
   how many leading ones its local prefix-cache hits already fill; the async engine
   puts it on ``engine.kv_loads``.
3. ``_take_kv_loads`` (event loop): starts ``_pull`` for the load (``_pull_failed`` at
   once when P no longer holds the KV).
4. ``_pull``: ``connector.pull(source, block_ids, num_local_hit_blocks, timeout_s)``
   copies P's blocks ``num_local_hit_blocks:`` into the request's; then
   ``engine.finish_kv_load`` (a command: the request joins the decode loop at the next
   step), or ``_pull_failed`` (below) when the pull raised; either way
   ``leases.release`` (ReleaseKV to P, in the background).
5. ``Decode`` streams the engine's outputs; the first response carries how the KV came
   (``KVTransfer.num_local_hit_blocks``: the load's).

A call without a KV handle (the gateway's conditional disaggregation: a short prompt, or
one mostly in this instance's prefix cache) skips 2-4: the engine prefills the prompt
here, in chunks of at most ``--decode-recompute-chunk`` tokens per step beside the running
decodes, and samples the first token itself; the stream starts with that token.

When the pull fails (or P says it no longer holds the KV), D does not recompute
the prompt unless the call allows it (``allow_recompute``, the gateway's last
resort): it ends the call with ``DATA_LOSS`` before any token, so the gateway can
prefill again — on the same P, whose prefix cache still has most of the blocks —
and hand the new KV over. A recompute, when allowed, runs in chunks of at most
``--decode-recompute-chunk`` tokens per step, so running streams keep their pace.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import grpc

from cluster.handle_signing import HandleRejected, verify_handle
from cluster.sampling_proto import sampling_params_from_proto
from decode_svc.leases import LeaseKeeper
from engine.scheduler_output import KVLoad
from kv_connector.base import KVConnector, KVSource, KVTransferError, TransferStats, block_count_error
from kv_connector.fingerprint import FingerprintMismatchError
from serving.convert import kv_source_from_proto, output_to_proto
from serving.instance import Instance, add_instance_arguments, engine_config, serve
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50071
DEFAULT_RECOMPUTE_CHUNK = 256
KVFailurePolicy = Literal["recompute", "fail"]


@dataclass(slots=True, eq=False)
class DecodeCall:
    """One Decode call in progress, as the pull and the stream share it."""

    source: KVSource | None  # P's blocks (``source.request_id`` is P's id for them); None: prefilled here
    allow_recompute: bool
    pull: asyncio.Task[None] | None = None  # while in flight
    transfer: disaggregation_pb2.KVTransfer | None = None  # how the KV came, once it has
    # Set when the call must end with an error instead of tokens (the engine request is aborted).
    end_code: grpc.StatusCode | None = None
    end_message: str = ""


class DecodeServicer(disaggregation_pb2_grpc.DecodeServicer):
    def __init__(self, instance: Instance, failure_policy: KVFailurePolicy, pull_timeout_s: float) -> None:
        if instance.connector is None:
            raise ValueError("a decode instance needs a KV connector")
        self.instance = instance
        self.connector: KVConnector = instance.connector
        self.failure_policy = failure_policy
        self.pull_timeout_s = pull_timeout_s
        self.leases = LeaseKeeper(on_lost=self._kv_lost, plane=instance.plane)
        self._calls: dict[str, DecodeCall] = {}
        self._load_taker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """On the serving event loop, once the engine runs."""
        self.leases.start()
        self._load_taker = asyncio.get_running_loop().create_task(self._take_kv_loads())

    async def close(self) -> None:
        if self._load_taker is not None:
            self._load_taker.cancel()
            await asyncio.gather(self._load_taker, return_exceptions=True)
        await self.leases.close()

    # -------------------------------------------------------------- the RPC

    async def Decode(self, request, context):  # noqa: N802 - gRPC signature
        request_id = request.request_id
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        local = not request.HasField("kv")  # conditional disaggregation: prefill here
        handle = request.kv
        source = (
            None if local else kv_source_from_proto(handle.request_id or request_id, handle, request.prompt_token_ids)
        )
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
        call = self._calls[request_id] = DecodeCall(source, request.allow_recompute)
        if source is not None:
            self.leases.hold(request_id, source.request_id, handle.prefill_address, handle.lease_s)
        else:
            self.instance.counters.num_local_prefills += 1
        stream = self.instance.engine.generate(
            list(request.prompt_token_ids),
            params,
            request_id=request_id,
            priority=request.priority,
            first_token_id=None if local else request.first_token_id,
            cache_salt=request.cache_salt or None,
        )
        first = True
        try:
            async for output in stream:
                if call.end_code is not None:
                    await context.abort(call.end_code, call.end_message)
                response = output_to_proto(output, disaggregation_pb2.DecodeResponse)
                if call.transfer is not None:
                    response.kv_transfer.CopyFrom(call.transfer)
                    call.transfer = None  # the first response only
                if local and first:
                    response.num_cached_tokens = output.num_cached_tokens
                first = False
                yield response
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            del self._calls[request_id]
            # A pull still in flight writes into this request's blocks when it lands: stop it
            # before the engine may free (and hand out) those blocks.
            if call.pull is not None and not call.pull.done():
                call.pull.cancel()
                await asyncio.gather(call.pull, return_exceptions=True)
            self.leases.release(request_id)  # a no-op once the pull released P
            await stream.aclose()  # aborts the request now if it has not finished

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
        self.instance.fingerprint.check_compatible(source.fingerprint, "decode", "prefill")
        if handle.connector and handle.connector != self.connector.name:
            raise ValueError(
                f"the KV handle is for the {handle.connector!r} connector; this decode instance uses "
                f"{self.connector.name!r}"
            )
        if (
            mismatch := block_count_error(
                len(source.block_ids), num_prompt_tokens, self.instance.fingerprint.block_size
            )
        ) is not None:
            raise ValueError(f"the KV handle does not fit this call's prompt: {mismatch}")

    async def Abort(self, request, context):  # noqa: N802
        found = request.request_id in self._calls
        self.instance.engine.abort(request.request_id)
        return disaggregation_pb2.AbortResponse(found=found)

    # ------------------------------------------------------------ KV pulls

    async def _take_kv_loads(self) -> None:
        """Start each pull the engine asks for (blocks are allocated for these prompts)."""
        while True:
            load = await self.instance.engine.kv_loads.get()
            call = self._calls.get(load.request_id)
            if call is None:
                continue  # the call ended before its blocks were allocated; the engine frees them
            if load.request_id not in self.leases:
                self._pull_failed(load, call, "the prefill instance no longer holds the KV")
                continue
            call.pull = asyncio.ensure_future(self._pull(load, call))

    async def _pull(self, load: KVLoad, call: DecodeCall) -> None:
        try:
            stats = await self.connector.pull(
                call.source, load.block_ids, load.num_local_hit_blocks, self.pull_timeout_s
            )
        except KVTransferError as error:
            self._pull_failed(load, call, str(error))
        else:
            self.instance.transfers.add(stats)
            call.transfer = _transfer_proto(stats, load.num_local_hit_blocks, recomputed=False)
            self.instance.engine.finish_kv_load(load.request_id, success=True)
            logger.info(
                "pulled %d blocks (%d bytes, %d messages) for %s in %.4f s",
                stats.num_blocks,
                stats.num_bytes,
                stats.num_messages,
                load.request_id,
                stats.seconds,
            )
        finally:
            self.leases.release(load.request_id)

    def _pull_failed(self, load: KVLoad, call: DecodeCall, reason: str) -> None:
        """Recompute locally when the call allows it; otherwise end the call before any token."""
        counters = self.instance.counters
        counters.num_kv_pull_failures += 1
        if call.allow_recompute and self.failure_policy == "recompute":
            logger.warning("KV pull for %s failed, recomputing the prompt here in chunks: %s", load.request_id, reason)
            counters.num_kv_recomputes += 1
            call.transfer = _transfer_proto(TransferStats(0, 0, 0.0), load.num_local_hit_blocks, recomputed=True)
            self.instance.engine.finish_kv_load(load.request_id, success=False)
        elif call.allow_recompute:
            logger.warning("KV pull for %s failed, failing the request: %s", load.request_id, reason)
            self._end(
                load.request_id,
                call,
                grpc.StatusCode.UNAVAILABLE,
                f"KV transfer from the prefill instance failed: {reason}",
            )
        else:
            self._hand_back(load.request_id, call, reason)

    def _kv_lost(self, request_id: str, reason: str) -> None:
        """P no longer holds a handle this instance holds: hand the request back now, unless it
        may recompute (then its pull fails at once when its blocks are allocated)."""
        call = self._calls.get(request_id)
        if call is not None and call.pull is None and not call.allow_recompute:
            self._hand_back(request_id, call, reason)

    def _hand_back(self, request_id: str, call: DecodeCall, reason: str) -> None:
        logger.warning("KV of %s cannot be pulled (%s): handing it back for another prefill", request_id, reason)
        self.instance.counters.num_kv_handbacks += 1
        self._end(
            request_id,
            call,
            grpc.StatusCode.DATA_LOSS,
            f"the prompt's KV could not be pulled ({reason}); prefill it again",
        )

    def _end(self, request_id: str, call: DecodeCall, code: grpc.StatusCode, message: str) -> None:
        call.end_code, call.end_message = code, message
        self.instance.engine.abort(request_id)  # the stream then yields the abort, and the call ends


def _transfer_proto(stats: TransferStats, num_local_hit_blocks: int, recomputed: bool) -> disaggregation_pb2.KVTransfer:
    return disaggregation_pb2.KVTransfer(
        num_pulled_blocks=stats.num_blocks,
        num_local_hit_blocks=num_local_hit_blocks,
        num_bytes=stats.num_bytes,
        seconds=stats.seconds,
        recomputed=recomputed,
    )


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


def run(args: argparse.Namespace) -> int:
    config = dataclasses.replace(engine_config(args, "decode"), max_num_prefill_tokens=args.decode_recompute_chunk)
    instance = Instance.create(args, "decode", config)
    servicer = DecodeServicer(instance, args.kv_failure_policy, args.kv_pull_timeout)
    asyncio.run(
        serve(
            instance,
            args,
            lambda server: disaggregation_pb2_grpc.add_DecodeServicer_to_server(servicer, server),
            on_start=servicer.start,
            on_stop=servicer.close,
        )
    )
    return 0
