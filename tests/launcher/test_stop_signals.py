"""launcher/stop_signals.py: a stop request set by SIGINT/SIGTERM, whose handler takes no lock.

``threading.Event.set()`` from a handler deadlocks when the signal lands while the main thread
holds the event's lock inside ``wait()``: ``splitserve up`` hung so in CI, sent Ctrl-C and SIGTERM
back to back. The handler's ``set()`` here is shown to run inside a wait on the same thread, and
processes given both signals back to back, however they fall, all stop."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import threading

import pytest

from launcher.stop_signals import StopSignal

WAITING_PROCESS = """
from launcher.stop_signals import StopSignal
stop = StopSignal().install()
print("waiting", flush=True)
while not stop.wait(0.0005):
    pass
print("stopped", flush=True)
"""


def test_wait_returns_at_its_timeout_unset_and_at_once_once_set() -> None:
    stop = StopSignal()
    assert not stop.is_set() and stop.wait(0.01) is False
    stop.set()
    stop.set()  # again: still one request
    assert stop.is_set() and stop.wait(None) is True


def test_a_handler_setting_it_in_the_middle_of_a_wait_on_the_same_thread_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a signal's handler can run: on the waiting thread, inside ``wait``. (An Event's
    ``set()`` there blocks forever on the lock its own thread holds.)"""
    stop = StopSignal()
    real_select = select.select

    def interrupted(*args):  # type: ignore[no-untyped-def]
        stop.set()  # the handler, run between two bytecodes of the wait
        return real_select(*args)

    monkeypatch.setattr(select, "select", interrupted)
    assert stop.wait(timeout=60) is True


def test_a_set_from_another_thread_wakes_a_wait_without_a_timeout() -> None:
    stop = StopSignal()
    waiting = threading.Thread(target=stop.wait)
    waiting.start()
    stop.set()
    waiting.join(timeout=60)
    assert not waiting.is_alive()


def test_processes_sent_ctrl_c_and_sigterm_back_to_back_all_stop() -> None:
    """The signals land wherever the loop is (in a wait, between two): each process stops."""
    for _ in range(20):
        process = subprocess.Popen([sys.executable, "-c", WAITING_PROCESS], stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None and process.stdout.readline().strip() == "waiting"
            process.send_signal(signal.SIGINT)
            process.send_signal(signal.SIGTERM)
            # It ends its loop (no hang), exiting 0, or killed by the SIGTERM where that came as
            # the interpreter was finishing, which puts back the default handlers.
            assert process.wait(timeout=60) in (0, -signal.SIGTERM)
            assert process.stdout.read().strip() == "stopped"
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
