"""Which asyncio event loop the gateway runs on (``--loop``, as uvicorn names the choice).

The gateway's work per streamed token is event-loop work: a gRPC message read, a callback or
two, an SSE chunk written to its socket. uvloop (libuv, in Cython) runs the loop's scheduling
and its socket transports in C, where asyncio's run them in Python; it is the loop uvicorn
picks by default when it is installed. ``auto`` does the same; ``asyncio`` keeps the
standard library's loop (to compare, or where uvloop does not install)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable

LOOPS = ("auto", "asyncio", "uvloop")


def resolved_loop(name: str) -> str:
    """``auto`` as the loop it picks here: uvloop where it is installed."""
    if name not in LOOPS:
        raise ValueError(f"--loop must be one of {', '.join(LOOPS)}, got {name!r}")
    if name == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return name


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What ``asyncio.Runner(loop_factory=...)`` takes for the loop named: None is asyncio's own."""
    if resolved_loop(name) == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as error:
        raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop); or --loop asyncio") from error
    return uvloop.new_event_loop
