"""Control calls to a prefill instance's KV leases: release, renew, abort. Torch-free:
the gateway and the decode service both make them.

They answer at once on the prefill side (recorded, applied between engine steps), so a
short deadline is enough; a failure is logged and otherwise ignored, because the lease
frees the blocks anyway when nobody releases or renews them.
"""

from __future__ import annotations

import logging

import grpc

from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0


async def release_kv(channel: grpc.aio.Channel, request_id: str, address: str) -> bool:
    """Unpin ``request_id``'s blocks on P; a no-op if they are already free. True if P answered."""
    return await _call_by_id(disaggregation_pb2_grpc.PrefillStub(channel).ReleaseKV, "ReleaseKV", request_id, address)


async def abort_prefill(channel: grpc.aio.Channel, request_id: str, address: str) -> bool:
    """Stop a prefill still running on P, or unpin what it pinned. True if P answered."""
    return await _call_by_id(disaggregation_pb2_grpc.PrefillStub(channel).Abort, "Abort", request_id, address)


async def _call_by_id(method: grpc.aio.UnaryUnaryMultiCallable, name: str, request_id: str, address: str) -> bool:
    try:
        await method(disaggregation_pb2.RequestRef(request_id=request_id), timeout=CONTROL_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        logger.warning(
            "%s of %s on %s failed (%s); its lease frees the blocks", name, request_id, address, error.code().name
        )
        return False
    return True


async def renew_kv(
    channel: grpc.aio.Channel, request_ids: list[str], address: str, timeout_s: float
) -> list[str] | None:
    """Extend the leases of ``request_ids`` on P. Returns the ids P no longer holds, or
    None when P did not answer (it may be gone: the pulls will tell)."""
    try:
        response = await disaggregation_pb2_grpc.PrefillStub(channel).RenewKV(
            disaggregation_pb2.RenewKVRequest(request_ids=request_ids), timeout=timeout_s
        )
    except grpc.aio.AioRpcError as error:
        logger.warning("RenewKV of %d leases on %s failed (%s)", len(request_ids), address, error.code().name)
        return None
    return list(response.unknown_request_ids)
