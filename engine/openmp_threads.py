"""Which threads own OpenMP thread teams, and why the thread that runs the engine's model
(the step thread, or a decode engine's model thread) should be the only one.

libgomp (the OpenMP runtime torch and the native kernels share) gives each thread that runs
a parallel region a team of worker threads of its own, kept for as long as that thread
lives. When the teams of a process hold more threads than it has CPUs, libgomp stops
spinning between parallel regions (its "throttled" spin count, about a hundred iterations):
a worker sleeps at the end of each region and the next one waits for it to wake up. A decode
step runs some 150 regions, so it pays that wake-up 150 times. Loading the model (parallel
torch ops) on the thread that then runs the event loop left that thread's team alive beside
the step thread's: on 2 CPUs, 1 + 1 + 1 threads, throttled, and every token paid for it
(docs/benchmarks.md, "The step thread's OpenMP team").

The same holds for every thread that runs torch while the engine computes: the event loop's
(a KV pull between tensor-parallel sizes copies heads into place there) and the workers that
copy KV in and out of LMCache. :func:`serial_openmp` makes such a thread run torch's parallel
loops serially, so it never starts a team: their copies are small beside a step, and a
throttled step thread costs every token.
"""

from __future__ import annotations

import ctypes
import functools
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


def serial_openmp() -> None:
    """From now on, torch runs its parallel loops serially on the calling thread, which so
    starts no OpenMP team (module docstring). Other threads keep their own thread counts: the
    count is the OpenMP thread's own (``omp_set_num_threads``), where ``torch.set_num_threads``
    would change every thread's. A no-op where torch runs without libgomp."""
    set_num_threads = _omp_set_num_threads()
    if set_num_threads is None:
        return
    import torch

    torch.get_num_threads()  # torch's first use on a thread sets the count to the process's: let it, then override
    set_num_threads(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """libgomp's ``omp_set_num_threads``, from the copy torch loaded (the native kernels link the
    same soname, engine/cpu_kernels.py), or None."""
    import torch  # noqa: F401 - loads the libgomp this looks for

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    if len(paths) != 1:
        return None  # none (no OpenMP), or two runtimes: which one torch calls is not known
    function = ctypes.CDLL(paths.pop()).omp_set_num_threads
    function.argtypes, function.restype = [ctypes.c_int], None
    return function
