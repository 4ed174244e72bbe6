"""A stop request from SIGINT or SIGTERM that a process's threads wait on, set without a lock.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread is.
A handler that calls ``threading.Event.set()`` takes the event's lock; if the main thread was
inside ``Event.wait()`` holding that same lock (entering or leaving the wait), the handler waits
for a lock its own thread holds, forever. Ctrl-C followed at once by SIGTERM (as a test or an
orchestrator stops a process) hits exactly that: the first signal wakes the wait, which takes
the lock back, and the second signal's handler runs right there. ``splitserve up`` hung so,
its gateway and instances running, until it was killed.

:class:`StopSignal` keeps the request in a pipe instead: the handler writes one byte (no lock,
and a write to a pipe is async-signal-safe), and a wait is a ``select`` on the pipe's read end,
which the signal's own wake-up interrupts at once. It offers the part of ``threading.Event``'s
interface the loops use (``set``, ``is_set``, ``wait``), from any thread.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Iterable


class StopSignal:
    def __init__(self) -> None:
        self._read_end, self._write_end = os.pipe()
        os.set_blocking(self._write_end, False)
        self._set = False

    def set(self) -> None:
        self._set = True
        with contextlib.suppress(BlockingIOError):  # full of earlier requests: readable already
            os.write(self._write_end, b"\0")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set (True) or ``timeout`` seconds have passed (False)."""
        if not self._set:
            select.select([self._read_end], [], [], timeout)  # PEP 475: retried after a handler, shorter
        return self._set

    def install(self, signals: Iterable[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> StopSignal:
        """Set by each of ``signals`` from now on (call from the main thread); returns itself."""
        for signum in signals:
            signal.signal(signum, lambda *_: self.set())
        return self
