"""Fire-and-forget work that must still finish: releasing KV on a peer after the request
that needed it has ended, freeing blocks after a control call has answered."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundTasks:
    """Tasks kept alive by a strong reference (asyncio holds only weak ones) until done,
    with their failures logged rather than lost."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self) -> None:
        """Until every task spawned so far (and any they spawn) has finished."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
