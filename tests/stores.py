"""Servers tests start on loopback: free ports, Redis, LMCache's ``lm://`` server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.processes import free_port as launcher_free_port

LMCACHE_ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING"}


def free_port() -> int:
    """A loopback port for a service a test starts (outside the kernel's ephemeral range)."""
    return launcher_free_port("127.0.0.1")


def wait_for_port(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def start_redis(
    password: str | None = None, tls: tuple[Path, Path, Path] | None = None, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """A Redis server on a free loopback port (or ``port``: to start one again where another
    stopped) and its URL; with ``password`` it requires it (``--requirepass``) and the URL
    carries it; with ``tls`` (certificate, key, CA) it speaks only TLS, and the URL is
    ``rediss://`` trusting that CA."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port()
    options = ["--requirepass", password] if password else []
    if tls is not None:
        cert, key, ca = tls
        options += [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
        ]
    else:
        options += ["--port", str(port)]
    process = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, process, 10.0)
    credentials = f":{password}@" if password else ""
    if tls is not None:
        return process, f"rediss://{credentials}127.0.0.1:{port}?ssl_ca_certs={tls[2]}"
    return process, f"redis://{credentials}127.0.0.1:{port}"


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
    """Signal a process (SIGTERM: let it drain), kill it if it overstays; its exit code."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def start_lm_server() -> tuple[subprocess.Popen, str]:
    """LMCache's own cache server (``python -m lmcache.v1.server HOST PORT``)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port)],
        env=LMCACHE_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, process, 30.0)
    return process, f"lm://127.0.0.1:{port}"
