"""The engine behind an asyncio API: services add requests, stream their outputs, abort them.

The step loop runs on a dedicated thread (torch releases the GIL in its kernels,
so the event loop stays responsive). Every change to engine state — adding,
aborting, releasing KV, finishing a KV pull — travels to that thread as a
command and runs between steps, with one exception: a hand-off (decode role)
arriving while the model computes is admitted at once, its blocks allocated and
its pull started, so that its KV is there when the step ends and it joins the
next one. Queued like the rest, it waited for that boundary to get blocks,
pulled during the following step, and joined only the step after: two and a
half steps on average from its arrival to its first token, the largest gap of
a P/D stream. The engine thread holds ``_state_lock`` for everything but the
model execution; the event loop only ever tries that lock (it never waits for
it: a hand-off arriving during the bookkeeping is queued as before).

Nothing on the event loop waits for a step: a prefill step can take seconds, and
control calls (abort, release, load reports, health) must answer in
milliseconds whatever the engine is doing. So :meth:`AsyncEngine.abort` and
:meth:`AsyncEngine.release_kv` only queue their command (it runs at the next
step boundary, in order with every other command), :meth:`AsyncEngine.generate`
validates on the caller's thread and queues the request, and load reports come
from the snapshot the engine thread publishes after each step.

A request's path, in call order:

1. ``generate()`` (event loop): validate, open the request's stream, queue ``add_request``.
2. Engine thread, between steps: ``add_request``; a refusal goes into the stream.
   A hand-off while the model computes: ``add_request`` and ``admit_handoffs`` on the
   event loop, its pull onto :attr:`AsyncEngine.kv_loads` at once.
3. Engine thread: ``step()``. The KV pulls it schedules (decode role) go to the event loop,
   onto :attr:`AsyncEngine.kv_loads`, before its forward pass; its outputs after it, both
   with ``call_soon_threadsafe``.
4. Event loop: ``_dispatch`` puts each output into its request's stream; ``generate()``
   yields it. The decode service takes loads off ``kv_loads``, pulls, and reports back
   with ``finish_kv_load()`` (a command again).
5. A consumer that stops early, ``abort()`` or ``release_kv()``: a command, applied at the
   next step boundary, freeing the request's blocks exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.engine_core import EngineCore, LoadReport
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_output import KVLoad

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Command = Callable[[], None]


class EngineDeadError(RuntimeError):
    """The step loop crashed; every in-flight request gets this."""


class AsyncEngine:
    """Owns an :class:`EngineCore` and its thread. Use as ``async with AsyncEngine(config) as engine``.

    Decode role: the KV pulls each step asks for arrive on :attr:`kv_loads` (on the
    event loop); whoever performs them reports back through :meth:`finish_kv_load`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.kv_loads: asyncio.Queue[KVLoad] = asyncio.Queue()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # Held by the engine thread except while a step's model executes (core.around_execute).
        self._state_lock = threading.Lock()
        self.core.around_execute = self._unlocked
        self._streams: dict[str, asyncio.Queue[EngineCoreOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # the step loop has exited: commands would never run
        self._error: BaseException | None = None
        # Replaced (never mutated) by the engine thread after each step and command batch, and by
        # the event loop when it admits a hand-off (both under the state lock).
        self._latest_report: LoadReport = self.core.load_report()
        # Requests handed to the engine thread whose add has not run yet (it runs between
        # steps, which can be seconds apart): the load report counts them as waiting.
        self._adds_lock = threading.Lock()
        self._num_adds_queued = 0
        self._num_prompt_tokens_queued = 0  # of those, prompt tokens to prefill here

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        # Pulls start as soon as a step has scheduled them, while it computes.
        self.core.on_kv_loads = lambda loads: loop.call_soon_threadsafe(_put_all, self.kv_loads, loads)
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the step loop; requests still in flight end with :class:`EngineDeadError`."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        """The step loop runs: started, and neither stopped nor crashed."""
        return self._thread is not None and not self._closed

    @property
    def error(self) -> BaseException | None:
        """What crashed the step loop, once it has."""
        return self._error

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ------------------------------------------------------------ requests

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        first_token_id: int | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[EngineCoreOutput]:
        """Stream a request's outputs as the engine produces them, until it finishes.

        Raises ValueError (before anything streams) for input the engine refuses.
        If the consumer stops iterating early — a client disconnected — the request
        is aborted and its blocks freed."""
        request_id = request_id or uuid.uuid4().hex
        if self._closed or self._thread is None:
            raise EngineDeadError("the engine step loop is not running") from self._error
        self.core.validate(prompt_token_ids, params, first_token_id)
        if params.structured is not None:
            # Compiling can take a while for a large schema: not on the event loop, not on
            # the engine thread (every running stream would wait); add_request hits the cache.
            await asyncio.to_thread(self.core.structured_output.compile, params.structured)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        loop = asyncio.get_running_loop()
        finished = False
        # A hand-off's prompt (decode role) is pulled, not prefilled here.
        num_prefill_tokens = len(prompt_token_ids) if first_token_id is None else 0
        self._count_queued_add(1, num_prefill_tokens)

        def add() -> None:
            self._count_queued_add(-1, -num_prefill_tokens)
            try:
                self.core.add_request(
                    prompt_token_ids,
                    params,
                    request_id=request_id,
                    priority=priority,
                    cache_salt=cache_salt,
                    first_token_id=first_token_id,
                )
            except ValueError as error:  # e.g. the id is still held by a pinned prefill
                loop.call_soon_threadsafe(stream.put_nowait, error)

        try:
            if first_token_id is not None and self._state_lock.acquire(blocking=False):
                try:
                    add()
                    loads = self.core.admit_handoffs()
                    self._latest_report = self.core.load_report()  # counts it from now, not from the next step
                finally:
                    self._state_lock.release()
                _put_all(self.kv_loads, loads)
                if all(load.request_id != request_id for load in loads):
                    # Left waiting (no blocks, or max_num_seqs reached): the engine thread, which
                    # may be asleep with nothing to run, retries at its next step.
                    self._submit(_nothing)
            else:
                self._submit(add)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                # A consumer that fell behind (a slow client, a busy event loop) gets every
                # output waiting as one: one message downstream instead of one per token.
                failure: BaseException | None = None
                while not item.finished and not stream.empty():
                    later = stream.get_nowait()
                    if isinstance(later, BaseException):
                        failure = later
                        break
                    item = merge_outputs(item, later)
                finished = item.finished
                yield item
                if failure is not None:
                    raise failure
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.core.abort([request_id]))

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary, freeing its blocks (pinned prefill KV too).
        Returns at once; unknown or finished ids are ignored."""
        self._submit(lambda: self.core.abort([request_id]))

    def release_kv(self, request_id: str) -> None:
        """Prefill role: unpin a handed-off request's blocks at the next step boundary.
        Returns at once; a second release of the same id does nothing."""
        self._submit(lambda: self.core.release_kv(request_id))

    def finish_kv_load(self, request_id: str, success: bool) -> None:
        """Decode role: report a KV pull's outcome; callable from any thread."""
        self._submit(lambda: self.core.finish_kv_load(request_id, success))

    async def load_report(self) -> LoadReport:
        """The load exactly, between steps (waits for the current step)."""
        return await self._call(self.core.load_report)

    def latest_load_report(self) -> LoadReport:
        """The load as of the latest step, at once, plus the requests queued for the engine
        thread since. Health and routing polls use this: a long prefill step takes seconds,
        an instance busy with one is not unhealthy, and what arrived during it is queued."""
        report = self._latest_report
        with self._adds_lock:
            num_adds, num_tokens = self._num_adds_queued, self._num_prompt_tokens_queued
        if not num_adds:
            return report
        return dataclasses.replace(
            report,
            num_waiting=report.num_waiting + num_adds,
            num_pending_prefill_tokens=report.num_pending_prefill_tokens + num_tokens,
        )

    # ------------------------------------------------------------ internals

    def _count_queued_add(self, num_adds: int, num_prompt_tokens: int) -> None:
        with self._adds_lock:
            self._num_adds_queued += num_adds
            self._num_prompt_tokens_queued += num_prompt_tokens

    def _submit(self, command: _Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result here."""
        if self._closed or self._thread is None:
            raise EngineDeadError("the engine step loop is not running") from self._error
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def command() -> None:
            try:
                result = fn()
            except BaseException as error:  # handed to the caller, never swallowed
                loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(command)
        return await future

    def _run(self) -> None:
        try:
            while not self._stopping:
                with self._state_lock:
                    outputs = self._next_step()
                if outputs is None:
                    self._sleep()
                elif outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)  # set by start(), before this thread runs
        except BaseException as error:
            logger.exception("engine step loop crashed")
            self._error = error
        finally:
            self._closed = True
            self._fail_all(EngineDeadError("the engine step loop has stopped"))

    def _next_step(self) -> list[EngineCoreOutput] | None:
        """The queued commands, then a step; None when there is nothing to step."""
        if self._drain_commands():
            self._latest_report = self.core.load_report()  # commands (aborts, releases) change it too
        elif self.core.last_step_was_idle:
            # Nothing could run (only pulls in flight, or no blocks to admit with): wait for a
            # command to change that rather than spin and starve the event loop of the GIL.
            return None
        if not self.core.has_unfinished_requests():
            return None
        outputs = self.core.step()
        # Before the outputs go out: a caller who has seen them sees a report at least as new.
        self._latest_report = self.core.load_report()
        return outputs

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """The state lock released for the duration (the engine thread, around the model)."""
        self._state_lock.release()
        try:
            yield
        finally:
            self._state_lock.acquire()

    def _sleep(self) -> None:
        self._wakeup.wait(timeout=0.5)
        self._wakeup.clear()

    def _drain_commands(self) -> bool:
        """Run every queued command; True if there was any."""
        ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return ran
            command()
            ran = True

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return

        def fail() -> None:
            for stream in self._streams.values():
                stream.put_nowait(error)

        self._loop.call_soon_threadsafe(fail)
        # Commands queued after the loop ended would wait forever: run them now.
        self._drain_commands()


def merge_outputs(earlier: EngineCoreOutput, later: EngineCoreOutput) -> EngineCoreOutput:
    """Two successive outputs of one request as one: tokens and logprobs in order, the
    later one's finish (and hand-off), the first one's prefix-cache count."""
    return EngineCoreOutput(
        request_id=earlier.request_id,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_logprobs=earlier.new_logprobs + later.new_logprobs,
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
        num_cached_tokens=earlier.num_cached_tokens,
        kv_handoff=later.kv_handoff,
    )


def _nothing() -> None:
    """A command that only wakes the engine thread."""


def _put_all(queue_: asyncio.Queue[T], items: list[T]) -> None:
    for item in items:
        queue_.put_nowait(item)


def _settle(future: asyncio.Future[Any], result: object, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
