"""An instance's Prometheus endpoint is open to anyone, so it is bounded (serving/metrics_http.py,
issue 42, item 7): real sockets on loopback hold every connection it serves and one more is
closed unread; each held one, idle or dripping its request a byte at a time, is closed at its
deadline (prometheus_client's own server kept them, a thread each, for as long as they stayed);
then a scrape is answered."""

from __future__ import annotations

import socket
import threading
import time

import httpx
from prometheus_client import CollectorRegistry, Gauge

from serving.metrics_http import start_metrics_http_server

CLOSED_WITHIN_S = 60.0  # the test's bound on a socket's end: generous, it fails a server that never closes it
DRIP_EVERY_S = 0.2  # the dripping client's pace: well inside the deadline, so only a total deadline ends it


def until_closed(connection: socket.socket, drip: bytes = b"") -> bytes:
    """What the server sent before it closed ``connection`` (dripping ``drip`` meanwhile)."""
    connection.settimeout(DRIP_EVERY_S if drip else CLOSED_WITHIN_S)
    received, started = b"", time.monotonic()
    while time.monotonic() - started < CLOSED_WITHIN_S:
        try:
            chunk = connection.recv(4096)
        except TimeoutError:
            drip = drip[1:] or b"a"
            connection.sendall(drip[:1])
            continue
        except ConnectionError:
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"still open after {CLOSED_WITHIN_S} s")


def test_connections_are_capped_and_closed_at_their_deadline() -> None:
    registry = CollectorRegistry()
    Gauge("splitserve_test_value", "a value to scrape", registry=registry).set(42)
    server, thread = start_metrics_http_server("127.0.0.1", 0, registry, max_connections=4, deadline_s=1.0)
    port = server.server_port
    try:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        held[0].sendall(b"GET /metrics HTTP/1.1\r\nX-Drip: ")
        one_more = socket.create_connection(("127.0.0.1", port))
        assert until_closed(one_more) == b""  # past the cap: closed unread
        endings: list[bytes] = [b""] * 4
        threads = [
            threading.Thread(target=lambda i=i: endings.__setitem__(i, until_closed(held[i], b"a" if i == 0 else b"")))
            for i in range(4)
        ]
        for waiter in threads:
            waiter.start()
        for waiter in threads:
            waiter.join()
        assert endings == [b""] * 4  # each closed at its deadline, with nothing sent
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert scrape.status_code == 200 and "splitserve_test_value 42.0" in scrape.text
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
