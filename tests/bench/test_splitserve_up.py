"""The benchmarks' ``splitserve up``: started as a user runs it, ready when it says so, a
start that fails reported at once, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from bench.splitserve_up import start_up, wait_ready
from launcher.processes import free_port


def test_started_cluster_is_ready_and_serves_its_model(model: Path, tmp_path: Path) -> None:
    port = free_port()
    with (tmp_path / "server.log").open("w") as log:
        server = start_up(port, "float32", ["--model", str(model), "--colocated"], log)
        try:
            wait_ready(f"http://127.0.0.1:{port}", server)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
                models = json.load(response)["data"]
            assert [entry["root"] for entry in models] == [str(model)]
        finally:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0


def test_wait_ready_fails_at_once_when_the_server_exits(tmp_path: Path) -> None:
    port = free_port()
    with (tmp_path / "server.log").open("w") as log:
        server = start_up(port, "float32", ["--model", str(tmp_path / "no-such-model"), "--colocated"], log)
        try:
            with pytest.raises(RuntimeError, match="exited"):
                wait_ready(f"http://127.0.0.1:{port}", server)
        finally:
            if server.poll() is None:
                server.kill()
            server.wait(timeout=30)
    assert "no-such-model" in (tmp_path / "server.log").read_text()
