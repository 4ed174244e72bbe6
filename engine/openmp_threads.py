"""Which threads own OpenMP thread teams, and why the engine's step thread should be the
only one.

libgomp (the OpenMP runtime torch and the native kernels share) gives each thread that runs
a parallel region a team of worker threads of its own, kept for as long as that thread
lives. When the teams of a process hold more threads than it has CPUs, libgomp stops
spinning between parallel regions (its "throttled" spin count, about a hundred iterations):
a worker sleeps at the end of each region and the next one waits for it to wake up. A decode
step runs some 150 regions, so it pays that wake-up 150 times. Loading the model (parallel
torch ops) on the thread that then runs the event loop left that thread's team alive beside
the step thread's: on 2 CPUs, 1 + 1 + 1 threads, throttled. Measured on a 2-vCPU AMD EPYC
(Zen 4), the Q4_1 SmolLM2 file in bf16 at two threads: 11.5 ms a token on the step thread
after loading on the main thread, 7.3 ms after loading on a thread that had ended, as fast as
steps on the main thread alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_passing_thread(make: Callable[[], T], name: str) -> T:
    """``make()`` on a thread of its own that ends with it, so that the OpenMP team any
    parallel work in it starts ends too; its result, or its exception re-raised here."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["result"] = make()
        except BaseException as error:  # re-raised on the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]
