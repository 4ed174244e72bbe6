"""The engine loads its model on a thread that ends, so that the OpenMP team the load's
parallel torch ops start ends with it: libgomp stops spinning between parallel regions once
the process's teams outnumber its CPUs, and a decode step on the step thread then took 11.5
ms a token instead of 7.3 (engine/openmp_threads.py). Thread counts show it, not timings."""

from __future__ import annotations

import subprocess
import sys
import threading
from unittest import mock

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.openmp_threads import run_in_passing_thread

# Threads of this process after parallel work on a passing thread, then on the main thread.
_PROBE = """
import os, time, torch
from engine.openmp_threads import run_in_passing_thread

def num_threads():
    return len(os.listdir("/proc/self/task"))

def parallel_work():
    return float((torch.ones(1 << 22) * 2).sum())  # far above torch's grain: a team of two

torch.set_num_threads(2)
before = num_threads()
assert run_in_passing_thread(parallel_work, "work") == float(2 << 22)
deadline = time.monotonic() + 60
while num_threads() > before and time.monotonic() < deadline:  # the ended team's workers exit
    time.sleep(0.01)
after_passing = num_threads()
parallel_work()
print(before, after_passing, num_threads())
"""


def test_parallel_work_on_a_passing_thread_leaves_no_openmp_team_behind() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    before, after_passing, after_main = map(int, result.stdout.split())
    assert after_passing == before
    assert after_main == before + 1  # the same work on the main thread keeps a worker alive


# Threads of this process while a live thread that called serial_openmp() has done parallel work,
# and the thread counts torch reports there and on the main thread.
_SERIAL_PROBE = """
import os, threading, torch
from engine.openmp_threads import serial_openmp

def num_threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
done, finish, seen = threading.Event(), threading.Event(), []

def worker():
    serial_openmp()
    seen.append((float((torch.ones(1 << 22) * 2).sum()), torch.get_num_threads()))
    done.set()
    finish.wait()

before = num_threads()
thread = threading.Thread(target=worker)
thread.start()
done.wait()
during = num_threads()
finish.set()
thread.join()
print(before, during, seen[0][0], seen[0][1], torch.get_num_threads())
"""


def test_a_serial_thread_starts_no_openmp_team_and_leaves_the_others_parallel() -> None:
    """The event loop's and the KV copy workers' threads (engine/openmp_threads.py): their torch
    work runs without a team of its own, while other threads keep the process's thread count."""
    result = subprocess.run([sys.executable, "-c", _SERIAL_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    before, during, total, serial_count, main_count = result.stdout.split()
    assert int(during) == int(before) + 1  # the worker itself, and no OpenMP worker beside it
    assert float(total) == float(2 << 22)
    assert (int(serial_count), int(main_count)) == (1, 2)


def test_a_passing_thread_returns_the_result_or_raises_the_error() -> None:
    assert run_in_passing_thread(lambda: threading.current_thread().name, "named") == "named"
    with pytest.raises(ValueError, match="refused"):
        run_in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("refused")), "failing")


def test_the_async_engine_builds_its_core_on_a_thread_of_its_own() -> None:
    built_on: list[threading.Thread] = []
    with mock.patch(
        "engine.async_engine.EngineCore", side_effect=lambda *args: built_on.append(threading.current_thread())
    ):
        AsyncEngine(EngineConfig(model="unused"))
    assert len(built_on) == 1 and built_on[0] is not threading.current_thread()
    assert not built_on[0].is_alive()
