"""The cluster secret: what lets a process into the internal plane (the gRPC calls
between gateway, prefill and decode instances), and the key prefill instances sign
KV handles with.

Two keys are derived from the secret with HMAC-SHA256 under labels of their own, so
neither is the secret itself:

- the **call token**, which every internal call carries in its metadata
  (:data:`METADATA_KEY`) and every instance compares in constant time. Without TLS it
  crosses the network in the clear: whoever reads one call can make calls.
- the **handle key**, which never leaves the process: P signs KV handles with it and D
  checks them (``cluster/handle_signing.py``). Reading calls on the wire is therefore
  not enough to forge a handle that D would pull from.

Health checks (``grpc.health.v1.Health``) stay open, so that orchestrators can probe an
instance without the secret; they reveal only SERVING or NOT_SERVING.

One call, in call order:

1. Client: :func:`cluster_token_interceptors` add the call token to the call's metadata
   (every channel to an instance is made by ``cluster.internal_grpc.InternalPlane``).
2. Server: :class:`ClusterTokenCheck` runs before the servicer. A call without the
   token, or with another, gets a handler that answers UNAUTHENTICATED without
   parsing the request; the servicer never sees it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

logger = logging.getLogger(__name__)

METADATA_KEY = "x-splitserve-cluster-token"  # gRPC metadata keys are lowercase
MIN_SECRET_CHARS = 16
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
_CALL_TOKEN_LABEL = b"splitserve internal gRPC call token v1"
_HANDLE_KEY_LABEL = b"splitserve KV handle signing key v1"
_LOG_REFUSALS_EVERY = 1000  # a flood of refused calls must not flood the log too


@dataclass(frozen=True, slots=True)
class ClusterSecret:
    """The keys derived from one cluster secret. Never printed (``repr`` hides them)."""

    call_token: str = field(repr=False)
    handle_key: bytes = field(repr=False)

    @classmethod
    def from_text(cls, secret: str) -> ClusterSecret:
        secret = secret.strip()
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"the cluster secret has {len(secret)} characters; use at least {MIN_SECRET_CHARS} random ones, "
                "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        key = secret.encode()
        return cls(
            call_token=hmac.new(key, _CALL_TOKEN_LABEL, hashlib.sha256).hexdigest(),
            handle_key=hmac.new(key, _HANDLE_KEY_LABEL, hashlib.sha256).digest(),
        )

    def accepts(self, presented: str | bytes | None) -> bool:
        """Whether a call presented this process's call token (constant time)."""
        if presented is None:
            return False
        if isinstance(presented, str):
            presented = presented.encode()
        return hmac.compare_digest(presented, self.call_token.encode())


def load_cluster_secret(secret: str | None, secret_file: str | None) -> ClusterSecret | None:
    """The secret from ``--cluster-secret`` (or its environment variable), else from the
    file ``--cluster-secret-file`` names (a compose or Kubernetes secret); None when neither
    is given. Raises ValueError when both are, or the file cannot be read."""
    if secret and secret_file:
        raise ValueError("give either --cluster-secret or --cluster-secret-file, not both")
    if secret_file:
        try:
            secret = Path(secret_file).read_text()
        except OSError as error:
            raise ValueError(
                f"cannot read the cluster secret from --cluster-secret-file {secret_file}: {error}"
            ) from None
    return ClusterSecret.from_text(secret) if secret else None


# ------------------------------------------------------------------ client side


class _AddsToken:
    """Adds the call token to a call's metadata (one subclass per kind of call below)."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._token = secret.call_token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA_KEY, self._token)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_AddsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStream(_AddsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnary(_AddsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStream(_AddsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


def cluster_token_interceptors(secret: ClusterSecret) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the call token to every call on a channel. One per kind of call:
    grpc.aio files an interceptor under the first kind it is an instance of, so a single
    object implementing all four would only ever see unary-unary calls."""
    return [kind(secret) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


# ------------------------------------------------------------------ server side


class ClusterTokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries this cluster's call token."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._secret = secret
        self.num_refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES) or self._secret.accepts(
            _metadata_value(handler_call_details.invocation_metadata)
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method: UNIMPLEMENTED, as without the check
        self.num_refused += 1
        if self.num_refused % _LOG_REFUSALS_EVERY == 1:
            logger.warning(
                "refused a call to %s without the cluster secret (%d refused since start)", method, self.num_refused
            )
        return _refusal(handler, method)


def _metadata_value(metadata: Sequence[tuple[str, Any]] | None) -> str | bytes | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value
    return None


def _refusal(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED. It has no
    request deserializer: an unauthenticated request is never parsed."""
    message = (
        f"{method} needs the cluster secret: start the caller with the same --cluster-secret "
        "(or SPLITSERVE_CLUSTER_SECRET / --cluster-secret-file) as this instance"
    )

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached: makes this an async generator, as streaming handlers are

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)
