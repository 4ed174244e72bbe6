"""The edge's admission gate: what a request must pass before the gateway does any costly
work for it (reading its body, parsing it, compiling a grammar, rendering a chat template,
tokenizing), checked cheapest first.

A REST request, in call order:

1. ``AdmissionGate`` (ASGI, outermost): paths open to all (probes, metrics, status) pass.
   Any other needs the API key, read from the ``Authorization`` header: 401, body unread.
2. The API paths (:data:`ADMITTED_PATHS`) then take a pending slot of
   ``--max-pending-requests`` (:class:`PendingSlots`): 429, body unread, when none is free, or
   when the client (its address) already holds ``--max-pending-requests-per-client``.
   The slot is the request's until its response has ended (a stream included), whatever
   ends it; the handler finds it with :func:`gate_pass_of`.
3. ``BodySizeLimit`` (``gateway/limits.py``) reads the body: 413 beyond ``--max-request-body-bytes``;
   ``LargeBodyCheck`` (``gateway/body_check.py``) checks a large one off the event loop: 400
   past ``--max-request-json-values`` or invalid.
4. The handler parses the body; a completion with several prompts takes one more slot per
   prompt past the first (``GatePass.take_more``) before any is tokenized; costly work runs
   on the bounded pools of ``gateway/work_pool.py`` under the request's client (its peer
   address), each with a time limit; then ``GenerationService.stream`` dispatches it.

A gRPC ``Generate`` call takes the same steps in its handler (``gateway/grpc_front.py``):
key, slot, work; gRPC has read its message by then (at most ``--max-request-body-bytes``).
Beneath both, ``gateway/connection_guard.py`` closes REST connections that are slow to send a
request or too many from one address, and answers 503 past ``--max-connections`` on all but the
probes' paths; the gRPC server refuses calls past the same number (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import NewType
from urllib.parse import unquote

from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from gateway.connection_guard import client_address
from gateway.errors import APIError, bearer_matches
from gateway.limits import ASGIApp, Receive, Scope, Send
from gateway.request_trace import EdgeTiming

logger = logging.getLogger(__name__)

# Who a request comes from, for fairness between clients in the pending slots and the work
# pools: the peer's address as the connection guard counts it (IPv4, or an IPv6 /64). Behind a
# proxy every request has the proxy's, and the gate sees one client.
ClientId = NewType("ClientId", str)

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
_GATE_PASS = "splitserve_gate_pass"  # the key of a request's GatePass in the ASGI scope's state


def client_of_scope(scope: Scope) -> ClientId:
    return ClientId(client_address(scope.get("client")))


def client_of_peer(peer: str) -> ClientId:
    """gRPC's ``context.peer()`` (``ipv4:10.0.0.1:5000``, ``ipv6:%5B::1%5D:5000``) without the port."""
    address = unquote(peer.partition(":")[2] or peer)
    host, colon, port = address.rpartition(":")
    if not (colon and port.isdigit()):
        return ClientId(address)
    return ClientId(client_address((host.strip("[]"), int(port))))


class PendingSlots:
    """The ``--max-pending-requests`` slots, of which one client (its address) holds at most
    ``max_per_client``, so that one client's flood leaves slots to the others (as the work
    pools leave them workers). Event-loop only: no lock."""

    def __init__(self, max_pending: int, max_per_client: int | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"--max-pending-requests must be >= 1, got {max_pending}")
        if max_per_client is not None and max_per_client < 1:
            raise ValueError(f"--max-pending-requests-per-client must be >= 1, got {max_per_client}")
        self.max_pending = max_pending
        self._max_per_client = max_per_client
        self.num_pending = 0
        self._pending_by_client: dict[ClientId, int] = {}

    @property
    def max_per_client(self) -> int:
        """The flag, else three quarters of ``max_pending`` (all of them below 4)."""
        return self._max_per_client or self.max_pending - self.max_pending // 4

    def admit(self, client: ClientId) -> GatePass:
        """One slot for a new request. Raises APIError 429 when none is free, or none of the client's share."""
        self._take(client, 1)
        return GatePass(client, self, 1)

    def _take(self, client: ClientId, num_slots: int) -> None:
        if self.num_pending + num_slots > self.max_pending:
            raise APIError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"the server is at its limit of {self.max_pending} requests in flight; retry later",
                code="queue_full",
                retry_after_s=1.0,
            )
        held = self._pending_by_client.get(client, 0)
        if held + num_slots > self.max_per_client:
            raise APIError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"this client has {held} requests in flight, at its limit of {self.max_per_client} "
                "(--max-pending-requests-per-client); retry later",
                code="client_queue_full",
                retry_after_s=1.0,
            )
        self.num_pending += num_slots
        self._pending_by_client[client] = held + num_slots

    def _give_back(self, client: ClientId, num_slots: int) -> None:
        self.num_pending -= num_slots
        held = self._pending_by_client.get(client, 0) - num_slots
        if held > 0:
            self._pending_by_client[client] = held
        else:
            self._pending_by_client.pop(client, None)


@dataclass(slots=True)
class GatePass:
    """A request past the gate: who sent it, the slots it holds until :meth:`release`, and
    when it arrived (its time to first token counts from then) and what the edge did for it."""

    client: ClientId
    _slots: PendingSlots
    num_slots: int
    timing: EdgeTiming = field(default_factory=EdgeTiming)

    def take_more(self, num_slots: int) -> None:
        """Slots for the extra prompts of one request. Raises APIError 429 when they are not free."""
        if num_slots > 0:
            self._slots._take(self.client, num_slots)
            self.num_slots += num_slots

    def release(self) -> None:
        """Give every slot back; a second call does nothing."""
        self._slots._give_back(self.client, self.num_slots)
        self.num_slots = 0


def gate_pass_of(request: Request) -> GatePass:
    gate_pass = request.scope.get("state", {}).get(_GATE_PASS)
    if not isinstance(gate_pass, GatePass):
        raise RuntimeError(f"bug: {request.url.path} was not admitted by the gate (gateway/gate.py ADMITTED_PATHS)")
    return gate_pass


class AdmissionGate:
    """ASGI middleware: the key, then a slot, before anything reads the body (steps 1 and 2 above)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        open_paths: Collection[str],
        slots: PendingSlots,
        refused: Counter,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = open_paths
        self.slots = slots
        self.refused = refused  # labelled by status, as finished requests are

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.api_key is not None:
            authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not bearer_matches(authorization.decode("latin-1"), self.api_key):
                error = APIError(
                    HTTPStatus.UNAUTHORIZED,
                    "invalid or missing API key; send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                await self._refuse(error, scope, receive, send)
                return
        if path not in ADMITTED_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            gate_pass = self.slots.admit(client_of_scope(scope))
        except APIError as error:
            await self._refuse(error, scope, receive, send)
            return
        scope.setdefault("state", {})[_GATE_PASS] = gate_pass
        try:
            await self.app(scope, receive, send)
        finally:
            gate_pass.release()

    async def _refuse(self, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        self.refused.labels(status=f"error_{error.status.value}").inc()
        headers = {"Connection": "close"}  # the body was never read: the connection cannot be reused
        if error.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
        response = JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=headers)
        await response(scope, receive, send)
