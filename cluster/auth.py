"""The cluster secret: what lets a process into the internal plane (the gRPC calls
between gateway, prefill and decode instances), the key prefill instances sign KV handles
with, and the key instances sign their registry records with.

Keys are derived from the secret with HMAC-SHA256 under labels of their own, so none is
the secret itself, and none ever leaves the process:

- the **call key**: every internal call carries a credential made with it for that one
  call (:func:`ClusterSecret.call_credential`, in the metadata under :data:`METADATA_KEY`):
  an HMAC over the method, the caller's clock (milliseconds) and a random nonce. An
  instance accepts it once, within :data:`CALL_WINDOW_S` of its own clock, for that method
  only; a replayed credential is refused. Reading calls on the wire (without TLS) therefore
  yields nothing to make calls with: each credential is spent by the call it came with.
- the **handle key**: P signs KV handles with it and D checks them
  (``cluster/handle_signing.py``).
- the **registry key**: instances sign their registry records with it and gateways check
  them (``cluster/registry_record.py``).

Health checks (``grpc.health.v1.Health``) stay open, so that orchestrators can probe an
instance without the secret; they reveal only SERVING or NOT_SERVING.

One call, in call order:

1. Client: :func:`cluster_call_interceptors` add a fresh credential to the call's metadata
   (every channel to an instance is made by ``cluster.internal_grpc.InternalPlane``).
2. Server: :class:`ClusterCallCheck` runs before the servicer: it checks the credential's
   MAC (constant time), then its timestamp, then that its nonce is new (remembered for
   twice the window, so that it cannot come back while its timestamp is acceptable). A
   call that fails any check gets a handler that answers UNAUTHENTICATED without parsing
   the request; the servicer never sees it. The check costs an HMAC over some 100 bytes
   and a set lookup: tens of microseconds, so control calls still answer in milliseconds.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

logger = logging.getLogger(__name__)

METADATA_KEY = "x-splitserve-call-credential"  # gRPC metadata keys are lowercase
MIN_SECRET_CHARS = 16
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
# How far hosts' clocks may disagree (NTP keeps them within milliseconds): call credentials and
# registry records dated further from the reader's clock are refused.
MAX_CLOCK_SKEW_S = 30.0
CALL_WINDOW_S = MAX_CLOCK_SKEW_S  # a call's timestamp, either way of the instance's clock
_CREDENTIAL_VERSION = "v1"
_NONCE_BYTES = 16
_CALL_KEY_LABEL = b"splitserve internal gRPC call key v2"
_HANDLE_KEY_LABEL = b"splitserve KV handle signing key v1"
_REGISTRY_KEY_LABEL = b"splitserve registry record signing key v1"
_LOG_REFUSALS_EVERY = 1000  # a flood of refused calls must not flood the log too


@dataclass(frozen=True, slots=True)
class ClusterSecret:
    """The keys derived from one cluster secret. Never printed (``repr`` hides them)."""

    call_key: bytes = field(repr=False)
    handle_key: bytes = field(repr=False)
    registry_key: bytes = field(repr=False)

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
            call_key=hmac.new(key, _CALL_KEY_LABEL, hashlib.sha256).digest(),
            handle_key=hmac.new(key, _HANDLE_KEY_LABEL, hashlib.sha256).digest(),
            registry_key=hmac.new(key, _REGISTRY_KEY_LABEL, hashlib.sha256).digest(),
        )

    def call_credential(self, method: str | bytes, unix_s: float | None = None) -> str:
        """A credential good for one call of ``method`` (``/package.Service/Method``), once,
        within :data:`CALL_WINDOW_S` of ``unix_s`` (default: now)."""
        if isinstance(method, bytes):
            method = method.decode()
        unix_ms = str(int((time.time() if unix_s is None else unix_s) * 1000))
        nonce = secrets.token_hex(_NONCE_BYTES)
        return f"{_CREDENTIAL_VERSION}.{unix_ms}.{nonce}.{self.call_mac(method, unix_ms, nonce)}"

    def call_mac(self, method: str, unix_ms: str, nonce: str) -> str:
        """The MAC of one call credential (hex): over the method, the timestamp and the nonce."""
        message = f"{_CREDENTIAL_VERSION}\n{method}\n{unix_ms}\n{nonce}".encode()
        return hmac.new(self.call_key, message, hashlib.sha256).hexdigest()


def load_cluster_secret(secret: str | None, secret_file: str | None) -> ClusterSecret | None:
    """The secret from ``--cluster-secret`` (or its environment variable), else from the
    file ``--cluster-secret-file`` names (a compose or Kubernetes secret); None when neither
    is given. Raises ValueError when both are, when the file cannot be read, or when the
    secret given is empty: an empty file (an empty Kubernetes Secret key, a ``touch``) or
    an empty variable must never quietly open the plane."""
    if secret is not None and secret_file:
        raise ValueError("give either --cluster-secret or --cluster-secret-file, not both")
    if secret_file:
        try:
            secret = Path(secret_file).read_text()
        except OSError as error:
            raise ValueError(
                f"cannot read the cluster secret from --cluster-secret-file {secret_file}: {error}"
            ) from None
        if not secret.strip():
            raise ValueError(
                f"--cluster-secret-file {secret_file} is empty: write the secret into it, e.g. "
                "python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE (the same file for gateway, "
                "prefill and decode)"
            )
    if secret is None:
        return None
    if not secret.strip():
        raise ValueError(
            "the cluster secret is given but empty (--cluster-secret '' or SPLITSERVE_CLUSTER_SECRET set to nothing): "
            "set it to the cluster's secret, or unset the variable to run without one on loopback"
        )
    return ClusterSecret.from_text(secret)


# ------------------------------------------------------------------ client side


class _AddsCredential:
    """Adds a fresh call credential to a call's metadata (one subclass per kind of call below)."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._secret = secret

    def _with_credential(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA_KEY, self._secret.call_credential(details.method))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_AddsCredential, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_credential(client_call_details), request)


class _UnaryStream(_AddsCredential, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_credential(client_call_details), request)


class _StreamUnary(_AddsCredential, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_credential(client_call_details), request_iterator)


class _StreamStream(_AddsCredential, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_credential(client_call_details), request_iterator)


def cluster_call_interceptors(secret: ClusterSecret) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding a call credential to every call on a channel. One per kind of call:
    grpc.aio files an interceptor under the first kind it is an instance of, so a single
    object implementing all four would only ever see unary-unary calls."""
    return [kind(secret) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


# ------------------------------------------------------------------ server side


class _SeenNonces:
    """Nonces of accepted credentials, each kept for twice the window after it arrived: a
    credential's timestamp is at most one window ahead of this clock when it arrives, and is
    refused one window after that timestamp, so it can never be accepted twice. Insertion
    order is expiry order, so forgetting is a pop from the left."""

    __slots__ = ("_expiries", "_nonces", "_keep_s")

    def __init__(self, window_s: float) -> None:
        self._keep_s = 2 * window_s
        self._nonces: set[str] = set()
        self._expiries: deque[tuple[float, str]] = deque()

    def __len__(self) -> int:
        return len(self._nonces)

    def add_if_new(self, nonce: str, now: float) -> bool:
        """Remember ``nonce``; False when it was seen already (a replay)."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            self._nonces.discard(expiries.popleft()[1])
        if nonce in self._nonces:
            return False
        self._nonces.add(nonce)
        expiries.append((now + self._keep_s, nonce))
        return True


class ClusterCallCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries a fresh credential made with this
    cluster's call key for that method."""

    def __init__(self, secret: ClusterSecret, window_s: float = CALL_WINDOW_S) -> None:
        self._secret = secret
        self._window_s = window_s
        self._seen = _SeenNonces(window_s)
        self.num_refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        problem = self.check(method, _metadata_value(handler_call_details.invocation_metadata), time.time())
        if problem is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method: UNIMPLEMENTED, as without the check
        self.num_refused += 1
        if self.num_refused % _LOG_REFUSALS_EVERY == 1:
            logger.warning("refused a call to %s: %s (%d refused since start)", method, problem, self.num_refused)
        return _refusal(handler, method, problem)

    @property
    def num_remembered(self) -> int:
        """Nonces of accepted calls still remembered (those of the last two windows at most)."""
        return len(self._seen)

    def check(self, method: str, presented: str | bytes | None, now: float) -> str | None:
        """Why a call presenting ``presented`` must be refused; None to let it through."""
        if presented is None:
            return "no call credential"
        if isinstance(presented, bytes):
            presented = presented.decode(errors="replace")
        parts = presented.split(".")
        if len(parts) != 4 or parts[0] != _CREDENTIAL_VERSION or not parts[1].isdigit():
            return "a malformed call credential (a caller from another splitserve version?)"
        _, unix_ms, nonce, mac = parts
        if not hmac.compare_digest(mac.encode(), self._secret.call_mac(method, unix_ms, nonce).encode()):
            return "a call credential made with another cluster secret, or for another method"
        skew_s = int(unix_ms) / 1000 - now
        if abs(skew_s) > self._window_s:
            return (
                f"a call credential {skew_s:+.1f} s off this instance's clock (at most {self._window_s:g} s either "
                "way): a replay, or hosts whose clocks disagree; keep them in sync (NTP)"
            )
        if not self._seen.add_if_new(nonce, now):
            return "a call credential used before (a replay)"
        return None


def _metadata_value(metadata: Sequence[tuple[str, Any]] | None) -> str | bytes | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value
    return None


def _refusal(handler: grpc.RpcMethodHandler, method: str, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED. It has no
    request deserializer: an unauthenticated request is never parsed."""
    message = (
        f"{method} needs the cluster secret ({problem}): start the caller with the same --cluster-secret "
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
