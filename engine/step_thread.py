"""Which thread may change engine state: the scheduler, the block pool and the prefix cache
have one writer, the engine's step thread (ARCHITECTURE.md, "One writer").

Every mutating method of :class:`~engine.scheduler.Scheduler` and
:class:`~engine.block_pool.BlockPool` checks it, so a change from any other thread is a
``RuntimeError`` at once rather than a race found weeks later. Until a thread claims the
state (an engine stepped by hand: offline ``LLM``, unit tests), the caller's thread is the
step thread and nothing is checked.
"""

from __future__ import annotations

import threading


class StepThreadOwner:
    def __init__(self) -> None:
        self._thread_id: int | None = None
        self._thread_name = ""

    def claim(self) -> None:
        """Called once by the thread that runs the engine's steps, before its first step."""
        self._thread_id = threading.get_ident()
        self._thread_name = threading.current_thread().name

    def check(self) -> None:
        """Raise RuntimeError when the calling thread is not the step thread that claimed the state."""
        if self._thread_id is not None and threading.get_ident() != self._thread_id:
            raise RuntimeError(
                f"bug: thread {threading.current_thread().name!r} changed engine state that only the step "
                f"thread {self._thread_name!r} may change; send the engine a message (engine/inbox.py) instead"
            )
