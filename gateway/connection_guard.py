"""The REST front's connections: a deadline for each part of a request and a cap per client
address on uvicorn's HTTP protocol, and the probes answered whatever the connection count.

uvicorn times a connection out only while it idles between requests (``--timeout-keep-alive``):
a socket that never sends its request line, or drips its headers or its body a byte at a
time (slowloris), holds its connection for as long as its client likes; and uvicorn's own
``limit_concurrency`` counts such sockets, so a few dozen of them, sent by anyone, no key
needed, had every path answer 503, the liveness probe included. Here, one connection, in
call order:

1. Accepted (``connection_made``): past ``--max-connections-per-client`` open from its
   client's address (an IPv4 address; an IPv6 /64, which one host commonly holds whole) it
   gets a 503 and is closed, its request unread; else the headers' deadline starts.
2. Request line and headers: within ``--timeout-request-headers`` of the connection's
   start or, on a kept-alive connection, of the first byte of its next request; else the
   connection is closed.
3. Body, from the end of the headers to the end of the message: within
   ``--timeout-request-body``, else closed (the app's next ``receive`` says the client left).
   A deadline that falls while the server itself holds reading back (uvicorn's flow control:
   the app has not taken what came, or a pipelined request waits its turn) starts again.
4. Between requests (the response being made, then idle): no deadline of ours; uvicorn's
   keep-alive timeout closes an idle connection.

Above the protocol, :class:`ConnectionLimit` (ASGI, outermost) answers 503 in OpenAI's error
shape past ``--max-connections`` open connections, on every path but :data:`PROBE_PATHS`:
an orchestrator's probes are answered whatever the count, so that a flood of connections
never gets a healthy gateway restarted.

Everything here runs on the event loop's thread: no lock.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import APIError
from gateway.limits import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

# Answered at any connection count: Kubernetes' liveness and readiness probes.
PROBE_PATHS = frozenset({"/health", "/ready"})
_LOG_EVERY = 1000  # a flood of refused or timed-out connections must not flood the log too

Phase = Literal["headers", "body", "between"]

# What a connection past its client's cap gets before it is closed: nothing of it was read,
# so this is all it costs.
_REFUSED_BODY = (
    APIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "too many connections from your address (--max-connections-per-client); retry later",
        code="too_many_connections",
    )
    .to_response()
    .model_dump_json()
    .encode()
)
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY)
)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int  # open connections past which all but the probes get 503
    max_per_client: int  # open connections from one client address
    headers_timeout_s: float  # request line and headers
    body_timeout_s: float  # the body, from the end of the headers

    def __post_init__(self) -> None:
        for flag, count in (
            ("--max-connections", self.max_connections),
            ("--max-connections-per-client", self.max_per_client),
        ):
            if count < 1:
                raise ValueError(f"{flag} must be >= 1, got {count}")
        for flag, seconds in (
            ("--timeout-request-headers", self.headers_timeout_s),
            ("--timeout-request-body", self.body_timeout_s),
        ):
            if not seconds > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {seconds}")


def client_address(client: tuple[str, int] | None) -> str:
    """What the per-client cap counts by: the peer's IPv4 address, or its IPv6 /64; behind a
    proxy, the proxy's."""
    if client is None:
        return "unknown"  # a Unix socket
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return client[0]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ConnectionGuard:
    """The open connections of one REST server, by client address; see the module docstring."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.num_open = 0
        self.num_refused = 0  # connections closed as they came, past their client's cap
        self.num_timed_out = 0  # connections closed at a deadline
        self._open_by_client: Counter[str] = Counter()

    @property
    def over_limit(self) -> bool:
        return self.num_open > self.limits.max_connections

    def protocol(self) -> type[asyncio.Protocol]:
        """The HTTP protocol class for ``uvicorn.Config(http=...)``, bound to this guard."""
        return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": self})

    def asgi(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind :class:`ConnectionLimit`."""
        return ConnectionLimit(app, self)

    def open(self, client: str) -> bool:
        """Count a new connection from ``client``; False (counted as refused) past its cap."""
        if self._open_by_client[client] >= self.limits.max_per_client:
            self.num_refused += 1
            if self.num_refused % _LOG_EVERY == 1:
                logger.warning(
                    "closed a connection from %s as it came: %d are open from there, the most "
                    "--max-connections-per-client allows (%d refused since start)",
                    client,
                    self._open_by_client[client],
                    self.num_refused,
                )
            return False
        self._open_by_client[client] += 1
        self.num_open += 1
        return True

    def close(self, client: str) -> None:
        self.num_open -= 1
        self._open_by_client[client] -= 1
        if not self._open_by_client[client]:
            del self._open_by_client[client]

    def timed_out(self, client: str, phase: Phase) -> None:
        self.num_timed_out += 1
        if self.num_timed_out % _LOG_EVERY == 1:
            flag = "--timeout-request-headers" if phase == "headers" else "--timeout-request-body"
            logger.warning(
                "closed a connection from %s that sent no complete request %s in time (%s; %d closed since start)",
                client,
                phase,
                flag,
                self.num_timed_out,
            )


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guard's cap and deadlines (module docstring).
    Made per server by :meth:`ConnectionGuard.protocol`, which sets :attr:`guard`."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # uvicorn's own: config, server_state, app_state
        super().__init__(*args, **kwargs)
        self._client_address: str | None = None  # set while the guard counts this connection
        self._phase: Phase = "headers"
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = client_address(self.client)
        if not self.guard.open(address):
            transport.write(_REFUSED)
            transport.close()
            return
        self._client_address = address
        self._expect("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self._client_address is not None:
            self.guard.close(self._client_address)
            self._client_address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == "between":  # the first bytes of the next request on a kept-alive connection
            self._expect("headers")
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._expect("body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        self._phase = "between"
        super().on_message_complete()

    def _expect(self, phase: Phase) -> None:
        self._cancel_deadline()
        self._phase = phase
        limits = self.guard.limits
        seconds = limits.headers_timeout_s if phase == "headers" else limits.body_timeout_s
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._client_address is None:
            return
        if self._phase == "body" and self.flow.read_paused:  # the server holds the body back, not the client
            self._expect("body")
            return
        self.guard.timed_out(self._client_address, self._phase)
        self.transport.close()


class ConnectionLimit:
    """ASGI, outermost: past ``--max-connections`` open connections, 503 (and the connection
    closed after it) on every path but the probes'."""

    def __init__(self, app: ASGIApp, guard: ConnectionGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.guard.over_limit and scope.get("path") not in PROBE_PATHS:
            error = APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the server is at its limit of {self.guard.limits.max_connections} connections; retry later",
                code="too_many_connections",
            )
            response = JSONResponse(
                error.to_response().model_dump(),
                status_code=error.status,
                headers={"Retry-After": "1", "Connection": "close"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
