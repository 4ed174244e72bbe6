"""The cluster secret: what lets a process into the internal plane (the gRPC calls
between gateway, prefill and decode instances), the key prefill instances sign KV handles
with, and the key instances sign their registry records with.

Keys are derived from the secret with HMAC-SHA256 under labels of their own, so none is
the secret itself, and none ever leaves the process:

- the **call key**: every internal call carries a credential made with it for that one
  call (:func:`ClusterSecret.call_credential`, in the metadata under :data:`METADATA_KEY`):
  an HMAC over the credential's format version, the method, the target instance, the
  caller's clock (milliseconds) and a random nonce (the *call MAC*), and an HMAC over that
  MAC and a SHA-256 digest of the request message's bytes (the *request MAC*). An instance
  accepts it once, for that method, at that instance, with that request, strictly within
  :data:`CALL_WINDOW_S` of its own clock. Reading calls on the wire (without TLS) therefore
  yields nothing to make calls with: each credential is spent by the call it came with, and
  is worth nothing at another instance or with another message.
- the **handle key**: P signs KV handles with it and D checks them
  (``cluster/handle_signing.py``).
- the **registry key**: instances sign their registry records with it and gateways check
  them (``cluster/registry_record.py``).

Health checks (``grpc.health.v1.Health``) stay open, so that orchestrators can probe an
instance without the secret; they reveal only SERVING or NOT_SERVING.

Design choices of the call credential (format ``v2``):

- **The target's identity is the address the client dialled** (``host:port``, the channel's
  target; :func:`normalize_address`), carried in clear in the credential and covered by the
  MAC. The client always knows it, before any call (an instance id would first have to be
  learnt by a call of its own). The server checks it against the addresses it answers to
  (:meth:`ClusterCallCheck.answer_to`, set by ``InternalPlane.add_port``): its advertised
  address (``--advertise-host``, default ``--host``, with the port it bound), which is what
  its registry record and the KV handles it signs carry and so what gateways and decode
  instances dial, and its bind address when that is not a wildcard (bound to every interface
  with no ``--advertise-host``: the host's name, its fully qualified name and their
  addresses, ``cluster.internal_grpc.this_hosts_names``). Behind
  ``--advertise-host`` the advertised name is the one peers use, so it matches; a client that
  dials an instance by another name (a static ``--prefill`` naming a DNS alias) is refused with
  a message naming both. No two instances answer to the same ``host:port``, so a credential
  read off a call to A is refused by B.
- **The request digest is over the raw bytes on the wire**, not over a re-serialized message:
  :class:`ClusterCallCheck` returns, per call, a handler whose request deserializer checks
  the MAC over the bytes gRPC received before it hands them to protobuf, so a request that
  fails is never parsed. Re-serializing with ``SerializeToString(deterministic=True)`` would
  also be deterministic for these messages (no maps), but it would accept any other encoding
  that parses to the same message (duplicate fields, unknown fields) and cost a second
  serialization on the server; the raw bytes cost neither. The client hashes
  ``request.SerializeToString()``, the very call the stub's serializer makes on the same
  message, so its bytes are those sent (an extra serialization on the client).
- **Streaming**: the unary-stream calls (``Decode``, ``Generate``) bind their one request
  message like unary ones. The one stream-request call, ``Multiplex.Calls`` (a gateway's
  ``Decode`` and ``Generate`` calls to an instance over one stream: serving/call_mux.py), is
  bound to method, target and time only (digest of no bytes), its nonce spent once like any
  other, and its messages unbound: a credential read off the wire opens no second stream, but
  whoever can inject bytes into an open connection could add calls to it, which TLS rules out
  (a ``Decode`` call's KV handle is still checked against P's signature, so such a call can
  only make D prefill a prompt of its own).
- **The window and the nonce cache**: a credential is accepted only while
  ``horizon < timestamp`` and ``now - window < timestamp < now + window`` (strict: at exactly
  the window's end it is refused). Accepted nonces are kept in a heap ordered by their
  credentials' timestamps; one is forgotten once its timestamp leaves the window, or, past
  :data:`MAX_REMEMBERED_NONCES`, the oldest is, and the *horizon* becomes the latest timestamp
  forgotten. A credential dated at or before the horizon is refused whatever the clock says,
  so when the clock steps back nothing forgotten can be replayed (a step back longer than the
  window refuses honest calls too until the clock has caught up; the refusal says so). The
  cache is bounded by count, and only calls that passed the MAC enter it.
- **Versions**: the credential opens with its format version (``v2``); an instance refuses
  another version saying which it takes, and a ``v1`` instance calls a ``v2`` credential
  malformed "(a caller from another splitserve version?)".

One call, in call order:

1. Client: :func:`cluster_call_interceptors` (made for one channel's target) add a fresh
   credential over the request message's bytes to the call's metadata (every channel to an
   instance is made by ``cluster.internal_grpc.InternalPlane``).
2. Server, when the call's headers arrive: :class:`ClusterCallCheck` checks the credential's
   form, version, target and call MAC (constant time); a call failing these gets a handler
   that answers UNAUTHENTICATED without reading its request into a hash or a parser, so a
   stranger's call costs one HMAC over some 100 bytes, whatever its size.
3. Server, when the request message arrives (before protobuf parses it): the checking
   deserializer checks the request MAC over the raw bytes' digest (constant time), then the
   timestamp against the window and the horizon, then that the nonce is new; on a refusal it
   returns a marker instead of a message, and the handler answers UNAUTHENTICATED. The
   servicer never sees a refused call. A member's call costs two HMACs over some 100 bytes,
   a SHA-256 of the request and a heap push.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import inspect
import logging
import secrets
import time
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
# Nonces an instance remembers at most: only members' calls (past the MAC) enter, and a window's
# worth at thousands of calls a second is well under it.
MAX_REMEMBERED_NONCES = 1 << 20
CREDENTIAL_VERSION = "v2"
_NONCE_BYTES = 16
_CALL_KEY_LABEL = b"splitserve internal gRPC call key v2"
_HANDLE_KEY_LABEL = b"splitserve KV handle signing key v1"
_REGISTRY_KEY_LABEL = b"splitserve registry record signing key v1"
_LOG_REFUSALS_EVERY = 1000  # a flood of refused calls must not flood the log too
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
_TARGET_SCHEMES = ("dns:///", "dns:", "ipv4:", "ipv6:")


def normalize_address(address: str) -> str:
    """``host:port`` as a credential names it: a channel target without its resolver scheme
    (``dns:///``, ``ipv4:``), the host in lower case."""
    address = address.strip()
    for scheme in _TARGET_SCHEMES:
        if address.startswith(scheme):
            address = address[len(scheme) :]
            break
    return address.lower()


def request_digest(request_bytes: bytes) -> bytes:
    """What a credential binds of the request: SHA-256 of the message's bytes on the wire."""
    return hashlib.sha256(request_bytes).digest()


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

    def call_credential(
        self, method: str | bytes, target: str, request_bytes: bytes, unix_s: float | None = None
    ) -> str:
        """A credential good for one call of ``method`` (``/package.Service/Method``) to the
        instance at ``target`` (the ``host:port`` dialled) carrying ``request_bytes`` (the
        serialized request message), once, within :data:`CALL_WINDOW_S` of ``unix_s`` (default: now)."""
        if isinstance(method, bytes):
            method = method.decode()
        target = normalize_address(target)
        unix_ms = str(int((time.time() if unix_s is None else unix_s) * 1000))
        nonce = secrets.token_hex(_NONCE_BYTES)
        call_mac = self.call_mac(method, target, unix_ms, nonce)
        request_mac = self.request_mac(call_mac, request_digest(request_bytes))
        # The target last: host names hold dots.
        return f"{CREDENTIAL_VERSION}.{unix_ms}.{nonce}.{call_mac}.{request_mac}.{target}"

    def call_mac(self, method: str, target: str, unix_ms: str, nonce: str) -> str:
        """The MAC of a credential's header (hex): over the format version, the method, the
        target, the timestamp and the nonce. Checked when the call's headers arrive, so that a
        stranger's call is refused before its request is read."""
        message = f"{CREDENTIAL_VERSION}\n{method}\n{target}\n{unix_ms}\n{nonce}".encode()
        return hmac.new(self.call_key, message, hashlib.sha256).hexdigest()

    def request_mac(self, call_mac: str, digest: bytes) -> str:
        """The MAC binding a credential (its header's MAC) to the request's digest (hex)."""
        message = f"{CREDENTIAL_VERSION} request\n{call_mac}\n".encode() + digest
        return hmac.new(self.call_key, message, hashlib.sha256).hexdigest()


def load_cluster_secret(secret: str | None, secret_file: str | None) -> ClusterSecret | None:
    """The secret from ``--cluster-secret`` (or its environment variable), else from the
    file ``--cluster-secret-file`` names (a compose or Kubernetes secret); None when neither
    is given. Raises ValueError when both are, when the file cannot be read, or when the
    secret given is empty: an empty file (an empty Kubernetes Secret key, a ``touch``) or
    an empty variable, nor a file path given empty (``SPLITSERVE_CLUSTER_SECRET_FILE=``), must never
    quietly open the plane."""
    if secret_file is not None and not secret_file.strip():
        raise ValueError(
            "--cluster-secret-file is given but names no file (SPLITSERVE_CLUSTER_SECRET_FILE set to nothing?): name "
            "the file that holds the cluster secret, or unset the variable to run without one on loopback"
        )
    if secret is not None and secret_file is not None:
        raise ValueError("give either --cluster-secret or --cluster-secret-file, not both")
    if secret_file is not None:
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
    """Adds a fresh call credential, for this channel's target and the call's request, to a
    call's metadata (one subclass per kind of call below)."""

    def __init__(self, secret: ClusterSecret, target: str) -> None:
        self._secret = secret
        self._target = normalize_address(target)

    def _with_credential(self, details: grpc.aio.ClientCallDetails, request_bytes: bytes) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(METADATA_KEY, self._secret.call_credential(details.method, self._target, request_bytes))
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_AddsCredential, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        # The stub's serializer is this same call on this same message: the bytes sent.
        details = self._with_credential(client_call_details, request.SerializeToString())
        return await continuation(details, request)


class _UnaryStream(_AddsCredential, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        details = self._with_credential(client_call_details, request.SerializeToString())
        return await continuation(details, request)


class _StreamUnary(_AddsCredential, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        # No stream-unary call exists on the internal plane; one would bind no message.
        return await continuation(self._with_credential(client_call_details, b""), request_iterator)


class _StreamStream(_AddsCredential, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_credential(client_call_details, b""), request_iterator)


def cluster_call_interceptors(secret: ClusterSecret, target: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding a call credential to every call on a channel to ``target`` (the
    ``host:port`` the channel dials). One per kind of call: grpc.aio files an interceptor under
    the first kind it is an instance of, so a single object implementing all four would only
    ever see unary-unary calls."""
    return [kind(secret, target) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


# ------------------------------------------------------------------ server side


class _SeenNonces:
    """Nonces of accepted credentials, ordered by their credentials' timestamps (a heap), and
    the *horizon*: the latest timestamp among those forgotten. A nonce is forgotten once its
    timestamp has left the window (it would be refused by the window then, were the clock never
    to step back), or when more than ``max_nonces`` are kept (the oldest first). The caller
    refuses any credential dated at or before the horizon, so that nothing forgotten is ever
    accepted again, whatever the clock does."""

    __slots__ = ("_heap", "_nonces", "_max_nonces", "horizon_ms")

    def __init__(self, max_nonces: int) -> None:
        self._max_nonces = max_nonces
        self._nonces: set[str] = set()
        self._heap: list[tuple[int, str]] = []
        self.horizon_ms = 0

    def __len__(self) -> int:
        return len(self._nonces)

    def forget_until(self, unix_ms: int) -> None:
        """Forget the nonces of credentials dated at or before ``unix_ms``."""
        heap = self._heap
        while heap and heap[0][0] <= unix_ms:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        unix_ms, nonce = heapq.heappop(self._heap)
        self._nonces.discard(nonce)
        self.horizon_ms = max(self.horizon_ms, unix_ms)

    def add_if_new(self, nonce: str, unix_ms: int) -> bool:
        """Remember ``nonce`` of a credential dated ``unix_ms``; False when it was seen already (a replay)."""
        if nonce in self._nonces:
            return False
        self._nonces.add(nonce)
        heapq.heappush(self._heap, (unix_ms, nonce))
        while len(self._heap) > self._max_nonces:
            self._forget_oldest()
        return True


@dataclass(frozen=True, slots=True)
class _Presented:
    """A credential's fields, parsed from the call's metadata."""

    unix_ms: int
    nonce: str
    call_mac: str
    request_mac: str
    target: str


@dataclass(frozen=True, slots=True)
class _Refused:
    """What the checking deserializer returns instead of a message: why the call is refused."""

    problem: str


class ClusterCallCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries a fresh credential made with this
    cluster's call key for that method, an address this instance answers to, and the request
    message it carries. ``clock``: the wall clock, in seconds (tests step it)."""

    def __init__(
        self,
        secret: ClusterSecret,
        window_s: float = CALL_WINDOW_S,
        clock: Callable[[], float] = time.time,
        max_remembered: int = MAX_REMEMBERED_NONCES,
    ) -> None:
        self._secret = secret
        self._window_ms = round(window_s * 1000)
        self._clock = clock
        self._seen = _SeenNonces(max_remembered)
        self._addresses: set[str] = set()
        self.num_refused = 0

    def answer_to(self, *addresses: str) -> None:
        """Accept credentials made for these ``host:port`` addresses (this instance's advertised
        and bound ones; wildcards are skipped: no client dials them)."""
        for address in addresses:
            host = address.rpartition(":")[0]
            if host not in WILDCARD_HOSTS:
                self._addresses.add(normalize_address(address))

    @property
    def addresses(self) -> frozenset[str]:
        return frozenset(self._addresses)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method: UNIMPLEMENTED, as without the check
        presented = self._parse(_metadata_value(handler_call_details.invocation_metadata), method)
        if isinstance(presented, str):
            self._count_refusal(method, presented)
            return _refusal(handler, method, presented)
        return self._checking(handler, method, presented)

    @property
    def num_remembered(self) -> int:
        """Nonces of accepted calls still remembered (at most those dated within the last window)."""
        return len(self._seen)

    def check(
        self, method: str, presented: str | bytes | None, request_bytes: bytes, now: float | None = None
    ) -> str | None:
        """Why a call of ``method`` presenting ``presented`` with the request ``request_bytes``
        must be refused; None to let it through (its nonce is then spent). ``now``: default the
        check's clock."""
        parsed = self._parse(presented, method)
        if isinstance(parsed, str):
            return parsed
        return self._verify(parsed, request_bytes, self._clock() if now is None else now)

    def _parse(self, presented: str | bytes | None, method: str) -> _Presented | str:
        """The credential's fields, or why it is refused before its request is read: its form,
        version, target and header MAC (a stranger's call goes no further)."""
        if presented is None:
            return "no call credential"
        if isinstance(presented, bytes):
            presented = presented.decode(errors="replace")
        version = presented.partition(".")[0]
        if version != CREDENTIAL_VERSION:
            if version[:1] == "v" and version[1:].isdigit():
                return (
                    f"a call credential of format {version}, and this instance takes {CREDENTIAL_VERSION}: the caller "
                    "runs another splitserve version; run one version on gateway, prefill and decode"
                )
            return "a malformed call credential (a caller from another splitserve version?)"
        parts = presented.split(".", 5)
        if len(parts) != 6 or not parts[1].isdigit() or not parts[5]:
            return "a malformed call credential (a caller from another splitserve version?)"
        _, unix_ms, nonce, call_mac, request_mac, target = parts
        if target not in self._addresses:
            return (
                f"a call credential made for {target}, but this instance answers to "
                f"{', '.join(sorted(self._addresses)) or 'no address yet'}: a credential read off a call to another "
                "instance, or a caller that dials this one by another name than it advertises (--advertise-host)"
            )
        if not hmac.compare_digest(call_mac.encode(), self._secret.call_mac(method, target, unix_ms, nonce).encode()):
            return "a call credential made with another cluster secret, or for another method"
        return _Presented(int(unix_ms), nonce, call_mac, request_mac, target)

    def _verify(self, presented: _Presented, request_bytes: bytes, now: float) -> str | None:
        expected = self._secret.request_mac(presented.call_mac, request_digest(request_bytes))
        if not hmac.compare_digest(presented.request_mac.encode(), expected.encode()):
            return "a call credential made for another request (altered in flight, or replayed with another)"
        now_ms = round(now * 1000)
        self._seen.forget_until(now_ms - self._window_ms)
        skew_ms = presented.unix_ms - now_ms
        if abs(skew_ms) >= self._window_ms:
            return (
                f"a call credential {skew_ms / 1000:+.1f} s off this instance's clock (less than "
                f"{self._window_ms / 1000:g} s either way): a replay, or hosts whose clocks disagree; keep them in "
                "sync (NTP)"
            )
        if presented.unix_ms <= self._seen.horizon_ms:
            return (
                "a call credential dated before the ones this instance has forgotten: a replay, or this instance's "
                "clock stepped back"
            )
        if not self._seen.add_if_new(presented.nonce, presented.unix_ms):
            return "a call credential used before (a replay)"
        return None

    def _checking(self, handler: grpc.RpcMethodHandler, method: str, presented: _Presented) -> grpc.RpcMethodHandler:
        """``handler`` with a request deserializer that checks the credential over the request's
        raw bytes before protobuf parses them, and behaviour that answers UNAUTHENTICATED when it
        failed."""
        parse = handler.request_deserializer

        def deserialize(request_bytes: bytes) -> Any:
            problem = self._verify(presented, request_bytes, self._clock())
            if problem is not None:
                return _Refused(problem)
            return parse(request_bytes) if parse is not None else request_bytes

        async def refuse(context: grpc.aio.ServicerContext, refused: _Refused) -> None:
            self._count_refusal(method, refused.problem)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _refusal_message(method, refused.problem))

        kwargs = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            serve = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Refused):
                    await refuse(context, request)
                result = serve(request, context)
                return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
        if handler.unary_stream is not None:
            serve_stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Refused):
                    await refuse(context, request)
                responses = serve_stream(request, context)
                if inspect.isawaitable(responses):  # a servicer that writes with context.write
                    await responses
                    return
                async for response in responses:
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
        # Stream-request calls: their messages are not bound (see the module's docstring); the
        # credential is checked over no bytes before the first message is read.
        problem = self._verify(presented, b"", self._clock())
        if problem is not None:
            self._count_refusal(method, problem)
            return _refusal(handler, method, problem)
        return handler

    def _count_refusal(self, method: str, problem: str) -> None:
        self.num_refused += 1
        if self.num_refused % _LOG_REFUSALS_EVERY == 1:
            logger.warning("refused a call to %s: %s (%d refused since start)", method, problem, self.num_refused)


def _metadata_value(metadata: Sequence[tuple[str, Any]] | None) -> str | bytes | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value
    return None


def _refusal_message(method: str, problem: str) -> str:
    return (
        f"{method} needs the cluster secret ({problem}): start the caller with the same --cluster-secret "
        "(or SPLITSERVE_CLUSTER_SECRET / --cluster-secret-file) as this instance"
    )


def _refusal(handler: grpc.RpcMethodHandler, method: str, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED. It has no
    request deserializer: an unauthenticated request is never parsed."""
    message = _refusal_message(method, problem)

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
