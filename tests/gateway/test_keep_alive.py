"""An idle keep-alive connection to the gateway stays open longer than HTTP clients keep one
in their pools, so a client never sends a request on a connection the gateway is closing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.gateway.processes import running_gateway
from tests.stores import free_port

REQUEST = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


def _status_on(connection: socket.socket) -> bytes:
    connection.sendall(REQUEST)
    return connection.recv(4096).split(b"\r\n", 1)[0]


def test_an_idle_connection_is_served_after_longer_than_uvicorns_default_and_the_flag_sets_it(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path)
    # An instance address nothing listens on: /health answers without one.
    nowhere = ("--colocated", f"127.0.0.1:{free_port()}")
    with (
        running_gateway(model, *nowhere, ready_path="/health") as gateway,
        socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as connection,
    ):
        assert _status_on(connection) == b"HTTP/1.1 200 OK"
        # Past uvicorn's default, which closes an idle connection after 5 s: the gateway leaves
        # it open (a close would read b"" at once).
        connection.settimeout(6.5)
        with pytest.raises(TimeoutError):
            connection.recv(4096)
        connection.settimeout(10)
        assert _status_on(connection) == b"HTTP/1.1 200 OK"
    with (
        running_gateway(model, *nowhere, "--timeout-keep-alive", "1", ready_path="/health") as gateway,
        socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as connection,
    ):
        assert _status_on(connection) == b"HTTP/1.1 200 OK"
        # Until the gateway closes it: at 1 s, the flag's; one that kept the default (75 s) would
        # run into this bound (socket timeout), far past the flag's and short of the default.
        connection.settimeout(60)
        assert connection.recv(4096) == b""  # closed by the gateway
