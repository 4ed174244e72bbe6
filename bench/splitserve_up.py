"""``splitserve up`` as the benchmarks start it (as a user runs it, on free ports, with no API
key), and waiting until a server answers."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from launcher.processes import free_port, splitserve_command

READY_TIMEOUT_S = 600.0


def start_up(
    port: int,
    dtype: str,
    flags: Sequence[str],
    log: IO[str],
    *,
    log_level: str = "WARNING",
    source_dir: Path | None = None,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """``splitserve up`` serving HTTP on ``port`` (gRPC on a free port), ``flags`` after the
    common ones, its output into ``log``. ``source_dir``: run that tree's code instead of
    this one's (a before/after comparison). ``new_session``: in a process group of its own,
    for a caller that signals the whole group."""
    command = splitserve_command(
        "--log-level",
        log_level,
        "up",
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--dtype",
        dtype,
        *flags,
        source_dir=source_dir,
    )
    env = {name: value for name, value in os.environ.items() if name != "SPLITSERVE_API_KEY"}  # served without a key
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)


def wait_ready(url: str, server: subprocess.Popen[bytes], path: str = "/ready") -> None:
    """Until ``url + path`` answers 200 (splitserve's /ready; another server's health path)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url}{path} did not answer 200 in time")
