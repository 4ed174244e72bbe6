"""Bounded thread pools for the gateway's costly work, fair between clients: one renders
chat templates, tokenizes and detokenizes (``gateway/tokenizer.py``), one compiles grammars
(``gateway/structured_request.py``). Nothing costly ever runs on the event loop, a flood
from one client is refused rather than queued without bound, and it never holds every
worker, so another client's request still gets its turn at once.

A task, in call order:

1. :meth:`WorkPool.run` (event loop): refused at once with 429 when its client already has
   ``max_waiting_per_client`` tasks waiting, or the pool ``max_waiting``; else queued under
   its client.
2. ``_start_next`` (event loop): each free worker takes the next task, clients in turn
   (round robin), skipping a client that already runs ``max_running_per_client`` tasks
   (every worker but one): one client's flood always leaves a worker to the others.
3. The worker thread runs ``work(stop)``. ``stop`` is set when the waiter gives up: the
   task's time limit (counted from its start, not from its queueing) or the waiter's
   cancellation (the client left). Work that can stop early polls it (a chat template's
   render does, ``gateway/chat_template.py``); other work runs to its end, bounded by its
   input (tokenizing: ``--max-prompt-chars``; a grammar: llguidance's own limits).
4. ``_finished`` (event loop, once the thread has returned): only now is the worker free
   again, so a pool never runs more than ``num_workers`` threads, whatever its waiters did.
   A waiter still waiting gets the result; a timed-out one has had ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from typing import Any, Generic, TypeVar

from gateway.errors import APIError
from gateway.gate import ClientId

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True, eq=False)  # eq=False: known by identity, in sets and queues
class _Task(Generic[T]):
    client: ClientId
    work: Callable[[threading.Event], T]
    timeout_s: float | None
    result: asyncio.Future[T]
    stop: threading.Event = field(default_factory=threading.Event)
    running: bool = False
    timer: asyncio.TimerHandle | None = None


class WorkPool:
    """``num_workers`` threads (at least 2, so that one is always left to other clients)."""

    def __init__(self, name: str, num_workers: int, max_waiting: int, max_waiting_per_client: int) -> None:
        if num_workers < 2:
            raise ValueError(f"a work pool needs at least 2 workers, got {num_workers}")
        if not 1 <= max_waiting_per_client <= max_waiting:
            raise ValueError(
                f"need 1 <= max_waiting_per_client ({max_waiting_per_client}) <= max_waiting ({max_waiting})"
            )
        self.name = name
        self.num_workers = num_workers
        self.max_running_per_client = num_workers - 1
        self.max_waiting = max_waiting
        self.max_waiting_per_client = max_waiting_per_client
        self.num_running = 0
        self.num_waiting = 0
        self.on_refused: Callable[[], object] = lambda: None  # the owner's metric
        self._waiting: OrderedDict[ClientId, deque[_Task[Any]]] = OrderedDict()  # clients in turn order
        self._running_by_client: dict[ClientId, int] = {}
        self._running: set[_Task[Any]] = set()
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix=name)

    async def run(self, client: ClientId, work: Callable[[threading.Event], T], timeout_s: float | None = None) -> T:
        """``work(stop)`` on a worker thread. Raises APIError 429 when the pool or the client's
        share of it is full, ``TimeoutError`` when the work runs past ``timeout_s``, and what
        ``work`` raises."""
        queue = self._waiting.get(client)
        if len(queue or ()) >= self.max_waiting_per_client or self.num_waiting >= self.max_waiting:
            self.on_refused()
            raise APIError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"the gateway's {self.name} queue is full ({len(queue or ())} of this client's "
                f"{self.max_waiting_per_client}, {self.num_waiting} of {self.max_waiting} in all); retry later",
                code="work_queue_full",
                retry_after_s=1.0,
            )
        task: _Task[T] = _Task(client, work, timeout_s, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(client, deque()).append(task)
        self.num_waiting += 1
        self._start_next()
        try:
            return await asyncio.shield(task.result)
        except asyncio.CancelledError:
            self._abandon(task)
            raise

    def close(self) -> None:
        """Stop the threads once their work has returned; waiting work is dropped."""
        for task in self._running:
            task.stop.set()
        for queue in self._waiting.values():
            for waiting in queue:
                waiting.result.cancel()
        self._waiting.clear()
        self.num_waiting = 0
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start_next(self) -> None:
        while self.num_running < self.num_workers:
            task = self._next_task()
            if task is None:
                return
            self._start(task)

    def _next_task(self) -> _Task[Any] | None:
        for client, queue in self._waiting.items():
            if self._running_by_client.get(client, 0) < self.max_running_per_client:
                task = queue.popleft()
                self.num_waiting -= 1
                del self._waiting[client]
                if queue:
                    self._waiting[client] = queue  # to the end of the turn order
                return task
        return None

    def _start(self, task: _Task[Any]) -> None:
        loop = asyncio.get_running_loop()
        task.running = True
        self.num_running += 1
        self._running_by_client[task.client] = self._running_by_client.get(task.client, 0) + 1
        self._running.add(task)
        if task.timeout_s is not None:
            task.timer = loop.call_later(task.timeout_s, self._time_out, task)
        thread_done = loop.run_in_executor(self._executor, task.work, task.stop)
        thread_done.add_done_callback(partial(self._finished, task))

    def _time_out(self, task: _Task[Any]) -> None:
        task.stop.set()
        if not task.result.done():
            task.result.set_exception(TimeoutError())

    def _abandon(self, task: _Task[Any]) -> None:
        """The waiter was cancelled: drop the task if it waits, stop it if it runs."""
        task.stop.set()
        if task.running:
            return
        queue = self._waiting.get(task.client)
        if queue is not None and task in queue:
            queue.remove(task)
            self.num_waiting -= 1
            if not queue:
                del self._waiting[task.client]
        task.result.cancel()

    def _finished(self, task: _Task[Any], thread_done: asyncio.Future[Any]) -> None:
        if task.timer is not None:
            task.timer.cancel()
        self.num_running -= 1
        self._running.discard(task)
        count = self._running_by_client[task.client] - 1
        if count:
            self._running_by_client[task.client] = count
        else:
            del self._running_by_client[task.client]
        error = None if thread_done.cancelled() else thread_done.exception()  # retrieved either way
        if task.result.done():  # timed out: its waiter has had TimeoutError
            pass
        elif task.stop.is_set() or thread_done.cancelled():  # abandoned, or dropped by close()
            task.result.cancel()
        elif error is not None:
            task.result.set_exception(error)
        else:
            task.result.set_result(thread_done.result())
        self._start_next()
