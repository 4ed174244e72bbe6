"""The process's ucxx context, set up for the event loop that moves KV.

ucxx keeps one context per process. By default it awaits a request by spinning the
event loop (``await asyncio.sleep(0)`` until the request completes), so a receive left
posted on an idle connection burns a core; that is why connections used to be opened
and closed for every pull. With ``enable_python_future`` a notifier thread completes
asyncio futures instead, and an idle connection costs next to nothing (docs/benchmarks.md,
"KV transfer"). It also frees the core a transfer
used to spin on for the transport's own work. The futures belong to the event loop
the context was created in, so the context is made again when a new loop (a test's
``asyncio.run``) first uses it.

The notifier thread is stopped when the interpreter exits.

Where UCX listens: ucxx 0.52's listener takes no address (it binds its connection
manager's socket to every address, whatever ``UCX_NET_DEVICES`` says), but UCX's TCP
transport listens, and moves data, only on the network devices ``UCX_NET_DEVICES``
names. :func:`limit_to_loopback` sets that to ``lo`` for a connector on a loopback
address, so a peer on another host can connect but cannot set up a data lane. On any
other address, firewall the KV port and set ``UCX_NET_DEVICES`` yourself (docs/security.md).

Everything in the process that speaks ucxx (the connector, and the KV benchmark's raw
UCX baseline) must get it from :func:`ucxx_for_running_loop`, before any other ucxx
call: ucxx cannot switch a context it created on its own to these settings.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import threading
import weakref
from types import ModuleType

logger = logging.getLogger(__name__)

_loop_ref: weakref.ReferenceType[asyncio.AbstractEventLoop] | None = None
_exit_hook_registered = False


def ucxx_for_running_loop() -> ModuleType:
    """The ``ucxx`` module, its context initialised (once per event loop) with the
    thread progress mode and asyncio futures completed by ucxx's notifier thread.

    Raises ``RuntimeError`` when called outside a running event loop, when ucxx was
    initialised by something else first, or when a previous loop's context still has
    open endpoints or listeners."""
    global _loop_ref, _exit_hook_registered
    import ucxx

    loop = asyncio.get_running_loop()
    if _loop_ref is not None and _loop_ref() is loop:
        return ucxx
    if _loop_ref is not None:
        try:
            ucxx.reset()  # the previous loop is finished; its futures cannot serve this one
        except ucxx.exceptions.UCXError:
            # A closed endpoint of the finished loop may still be held by a reference cycle (a
            # failed pull's traceback): collect those, then try once more.
            gc.collect()
            try:
                ucxx.reset()
            except ucxx.exceptions.UCXError as error:
                raise RuntimeError(
                    f"ucxx is still in use by a previous event loop (close its connectors first): {error}"
                ) from None
    try:
        ucxx.init(progress_mode="thread", enable_python_future=True)
    except RuntimeError as error:
        raise RuntimeError(
            f"ucxx was initialised before the KV connector ({error}); call "
            "kv_connector.ucx_context.ucxx_for_running_loop() before any other ucxx call"
        ) from None
    _loop_ref = weakref.ref(loop)
    if not _exit_hook_registered:
        # The notifier thread is not a daemon: stop it when the interpreter shuts down, before
        # it joins non-daemon threads (the hook concurrent.futures uses for its workers), or
        # the process never exits.
        threading._register_atexit(ucxx.stop_notifier_thread)  # type: ignore[attr-defined]  # CPython-private, not in typeshed
        _exit_hook_registered = True
    return ucxx


def limit_to_loopback(host: str) -> bool:
    """Before the first ucxx call of a connector bound to ``host``: when ``host`` is a
    loopback address and ``UCX_NET_DEVICES`` is unset, set it to ``lo``. Returns whether it
    did. Devices that are not network devices (shared memory, cuda_ipc) are unaffected."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback or "UCX_NET_DEVICES" in os.environ:
        return False
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if _loop_ref is not None and running is not None and _loop_ref() is running:
        logger.warning(
            "ucxx is already initialised for this event loop; UCX_NET_DEVICES=lo applies from the next one only"
        )
    os.environ["UCX_NET_DEVICES"] = "lo"
    return True
