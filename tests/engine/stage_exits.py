"""Process targets for the pipeline-parallel test of a chain of stage exits: plain functions,
in a module of their own that a spawned process imports by name."""

from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing.connection import Connection

from engine.tensor_parallel.worker import STAGE_GONE_EXIT_CODE


def killed_when_closed(control: Connection) -> None:
    """Stage 0: killed outright once its control pipe closes."""
    with contextlib.suppress(EOFError):
        control.recv_bytes()
    os.kill(os.getpid(), signal.SIGKILL)


def exits_after_its_link(to_rank_zero: Connection, from_stage_zero: Connection) -> None:
    """Stage 1: its link to rank 0 closes first; it exits, as a stage whose peer went, only once
    stage 0 is gone: the order in which a real stage's file closes and its exit are seen."""
    to_rank_zero.close()
    with contextlib.suppress(EOFError):
        from_stage_zero.recv_bytes()
    raise SystemExit(STAGE_GONE_EXIT_CODE)
