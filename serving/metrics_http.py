"""The HTTP server of an instance's Prometheus endpoint (``--metrics-port``), bounded.

prometheus_client's ``start_http_server`` starts a thread for every connection and gives none
of them a deadline: anyone who reaches the port (it is open, as the gateway's ``/metrics`` is)
can hold threads for as long as they keep sockets open, as many as they open (issue 42,
item 7). This one is the same WSGI app (``prometheus_client.make_wsgi_app``) on wsgiref's
server, with:

- at most ``max_connections`` connections served at once; one more is closed unread;
- each connection closed ``deadline_s`` after it was accepted, whatever it is doing (sending
  its request a byte at a time, or reading the answer slowly): a scrape takes milliseconds.

A connection, in call order: ``serve_forever`` (the server's thread) accepts it and calls
:meth:`BoundedWSGIServer.process_request`, which takes a slot or closes it; the connection's
own thread (``process_request_thread``) arms its deadline, serves it, then disarms the deadline
and gives the slot back.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

DEFAULT_MAX_CONNECTIONS = 16  # Prometheus scrapes over one connection at a time
DEFAULT_DEADLINE_S = 10.0  # Prometheus's own scrape timeout by default


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line on stderr per scrape."""


class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    max_connections = DEFAULT_MAX_CONNECTIONS
    deadline_s = DEFAULT_DEADLINE_S

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # past the cap: closed unread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(self.deadline_s, _cut, (request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()


def _cut(connection: socket.socket) -> None:
    """Past the deadline: end the connection under whatever its thread is doing."""
    with contextlib.suppress(OSError):  # closed already
        connection.shutdown(socket.SHUT_RDWR)


def start_metrics_http_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> tuple[BoundedWSGIServer, threading.Thread]:
    """Serve ``registry`` at ``http://host:port/metrics`` on a daemon thread; stop it with the
    server's ``shutdown`` and ``server_close``."""

    class Server(BoundedWSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    Server.max_connections, Server.deadline_s = max_connections, deadline_s
    server = make_server(host, port, make_wsgi_app(registry), Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
