"""``--loop``: the gateway runs on uvloop where it is installed (``auto``, as uvicorn picks),
on asyncio's own loop when asked, and says which on its ``/metrics``."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
import uvloop

from gateway.event_loop import loop_factory, resolved_loop
from tests.gateway.processes import running_gateway
from tests.stores import free_port


def test_auto_is_uvloop_where_installed_and_asyncio_is_the_standard_loop() -> None:
    assert resolved_loop("auto") == resolved_loop("uvloop") == "uvloop"
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="--loop must be one of"):
        resolved_loop("trio")


@pytest.mark.parametrize(("flags", "expected"), [((), "uvloop"), (("--loop", "asyncio"), "asyncio")])
def test_the_gateway_process_runs_on_the_loop_asked_and_says_which(
    model: Path, flags: tuple[str, ...], expected: str
) -> None:
    # No instance answers (a port nobody listens on): the gateway serves its own endpoints all the same.
    unreachable = f"127.0.0.1:{free_port()}"
    with running_gateway(model, "--colocated", unreachable, *flags, ready_path="/health") as gateway:
        text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    info = re.search(r"^splitserve_api_server_info\{(.*)\} 1\.0$", text, re.MULTILINE)
    assert info is not None and f'loop="{expected}"' in info[1]
