"""A TCP proxy for tests that stands in for a slow store: it forwards both ways until
:meth:`StallingProxy.stall`, then holds what clients send (without reading it) until
:meth:`StallingProxy.resume`; :attr:`StallingProxy.holding` is set once something is held.
``stall(both_ways=True)`` holds what the server sends too: a host gone silent without closing
its connections (a dead NIC, a partition). Runs on threads of the test process, on a free
loopback port."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator

_POLL_S = 0.05  # how often an idle pump looks at the gate: a pump's loop, not a test's wait


class StallingProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open = threading.Event()  # clear: hold clients' bytes
        self._open.set()
        self._both_ways = False  # while stalled: hold the server's bytes too
        self.holding = threading.Event()  # set once a client's bytes are held
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def stall(self, both_ways: bool = False) -> None:
        self.holding.clear()
        self._both_ways = both_ways
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, destination: socket.socket, gated: bool) -> None:
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([source], [], [], _POLL_S)
                if not readable:
                    continue
                if (gated or self._both_ways) and not self._open.is_set():
                    self.holding.set()
                    self._open.wait()
                    continue
                data = source.recv(1 << 16)
                if not data:
                    break
                destination.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, destination):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def stalling_proxy(url: str) -> Iterator[tuple[StallingProxy, str]]:
    """A proxy in front of the Redis at ``redis://HOST:PORT`` and the URL to reach it through."""
    host, _, port = url.removeprefix("redis://").rpartition("@")[2].partition(":")
    proxy = StallingProxy(host, int(port))
    try:
        yield proxy, f"redis://127.0.0.1:{proxy.port}"
    finally:
        proxy.close()
