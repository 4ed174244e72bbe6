"""``splitserve up --api-server-count N`` reaches the gateway it starts (gateway/api_servers.py)."""

from __future__ import annotations

from pathlib import Path

from gateway.flags import add_gateway_arguments
from launcher.up import add_arguments, gateway_flags
from tests.launcher.test_tracing_flags import ROUTES, parsed


def test_the_count_reaches_the_gateway() -> None:
    up = parsed(add_arguments, "--api-server-count", "3")
    assert parsed(add_gateway_arguments, *gateway_flags(up, Path("/m"), ROUTES)).api_server_count == 3


def test_one_process_by_default() -> None:
    up = parsed(add_arguments)
    gateway = parsed(add_gateway_arguments, *gateway_flags(up, Path("/m"), ROUTES))
    assert gateway.api_server_count == 1 and gateway.api_server_index is None
