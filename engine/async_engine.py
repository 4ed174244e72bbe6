"""The engine behind an asyncio API: services add requests, stream their outputs, abort them.

The step loop runs on a dedicated thread (torch releases the GIL in its kernels,
so the event loop stays responsive). Every change to engine state travels to that
thread as a command and runs between steps, with one exception that the scheduler
owns: a hand-off (decode role) arriving while a step's model computes is admitted at
once, inside the scheduler's hand-off window, so that its KV loads during that step
and it decodes in the next one (engine/scheduler.py, ``handoff_window``).

Nothing on the event loop waits for a step: a prefill step can take seconds, and
control calls (abort, release, load reports, health) must answer in milliseconds
whatever the engine is doing. So :meth:`AsyncEngine.abort` and
:meth:`AsyncEngine.release_kv` only queue their command, :meth:`AsyncEngine.generate`
validates on the caller's thread and queues the request, and load reports come from
the snapshot the engine publishes after each step.

A request's path, in call order:

1. ``generate()`` (event loop): validate, open the request's stream, queue ``add_request``
   (a hand-off while a step computes: ``add_handoff_during_step`` instead, admitted now).
2. Engine thread, between steps: the queued commands, then ``step()``, whose outputs go to
   the event loop with ``call_soon_threadsafe``. KV loads (decode role) are the engine's
   own: the scheduler starts them and polls them at step boundaries (engine/kv_loader.py);
   a loader that finishes one wakes an idle engine thread.
3. Event loop: ``_dispatch`` puts each output into its request's stream; ``generate()``
   yields it.
4. A consumer that stops early, ``abort()`` or ``release_kv()``: a command, applied at the
   next step boundary, freeing the request's blocks exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from engine.config import EngineConfig
from engine.engine_core import EngineCore, LoadReport
from engine.kv_loader import KVLoader, KVLoadFailurePolicy
from engine.openmp_threads import run_in_passing_thread
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Command = Callable[[], object]  # run for its effect; a result is dropped
IDLE_WAIT_S = 0.5  # an idle engine thread looks again this often even if nothing wakes it


class EngineDeadError(RuntimeError):
    """The step loop crashed; every in-flight request gets this."""


class AsyncEngine:
    """Owns an :class:`EngineCore` and its thread. Use as ``async with AsyncEngine(config) as engine``."""

    def __init__(self, config: EngineConfig) -> None:
        # Loaded on a thread that ends: the step thread's OpenMP team is then the process's
        # only one, and its workers spin between a step's parallel regions (engine/openmp_threads.py).
        # Not with tensor-parallel workers: they die with the thread that started them
        # (PR_SET_PDEATHSIG follows the parent thread, not the process).
        if config.tensor_parallel_size == 1:
            self.core = run_in_passing_thread(lambda: EngineCore(config), name="engine-load")
        else:
            self.core = EngineCore(config)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[EngineCoreOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # the step loop has exited: commands would never run
        self._error: BaseException | None = None
        # Requests handed to the engine thread whose add has not run yet (it runs between
        # steps, which can be seconds apart): the load report counts them as waiting.
        self._adds_lock = threading.Lock()
        self._num_adds_queued = 0
        self._num_prompt_tokens_queued = 0  # of those, prompt tokens to prefill here

    # ------------------------------------------------------------ lifecycle

    async def start(self, kv_loader: KVLoader | None = None) -> None:
        """Start the step loop. ``kv_loader`` (decode role): what fills hand-offs' blocks; it
        comes at start, not construction, because it wraps a connector built on this engine's
        KV cache."""
        if kv_loader is not None:
            self.core.use_kv_loader(kv_loader, wake=self._wakeup.set)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the step loop; requests still in flight end with :class:`EngineDeadError`."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.core.close()

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
        kv_load_failure_policy: KVLoadFailurePolicy = "recompute",
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Stream a request's outputs as the engine produces them, until it finishes.

        ``first_token_id`` (decode role): the prompt was prefilled elsewhere and its KV is
        loaded here; ``kv_load_failure_policy`` says what happens if it cannot be (``fail``:
        the stream ends with finish reason "error"). Raises ValueError (before anything
        streams) for input the engine refuses. If the consumer stops iterating early — a
        client disconnected — the request is aborted and its blocks freed."""
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
        added = False  # the engine holds the request (only aborted then: the id may be another's)
        # A hand-off's prompt (decode role) is loaded, not prefilled here; a prompt's cached
        # prefix is not prefilled either: counted in full while queued, a request that will hit
        # a cached system prompt made a prefill instance look seconds busier than it was, and
        # cache-aware routing sent the next request of that prefix elsewhere.
        num_prefill_tokens = (
            len(prompt_token_ids)
            - self.core.kv_cache_manager.num_cached_prompt_tokens(
                prompt_token_ids, cache_salt.encode() if cache_salt else b""
            )
            if first_token_id is None
            else 0
        )
        add_request = functools.partial(
            self.core.add_request,
            prompt_token_ids,
            params,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            first_token_id=first_token_id,
            kv_load_failure_policy=kv_load_failure_policy,
        )

        def add() -> None:
            nonlocal added
            self._count_queued_add(-1, -num_prefill_tokens)
            try:
                add_request()
                added = True
            except ValueError as error:  # e.g. the id is still held by a pinned prefill
                loop.call_soon_threadsafe(stream.put_nowait, error)

        def abort() -> None:
            if added:
                self.core.abort([request_id])

        try:
            if first_token_id is not None:
                added = self.core.add_handoff_during_step(add_request)
            if not added:
                self._count_queued_add(1, num_prefill_tokens)
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
                self._submit(abort)

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary, freeing its blocks (pinned prefill KV too;
        a hand-off's once its load has stopped). Returns at once; unknown or finished ids are
        ignored."""
        self._submit(lambda: self.core.abort([request_id]))

    def release_kv(self, request_id: str) -> None:
        """Prefill role: unpin a handed-off request's blocks at the next step boundary.
        Returns at once; a second release of the same id does nothing."""
        self._submit(functools.partial(self.core.release_kv, request_id))

    def latest_load_report(self) -> LoadReport:
        """The load as of the latest step (or hand-off admission), at once, plus the requests
        queued for the engine thread since. Health and routing polls use this: a long prefill
        step takes seconds, an instance busy with one is not unhealthy, and what arrived
        during it is queued."""
        report = self.core.published_load_report
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

    def _run(self) -> None:
        try:
            while not self._stopping:
                # Cleared before looking for work: a wake-up from now on is never lost.
                self._wakeup.clear()
                stepped = self._next_step()
                if not stepped or self.core.last_step_was_idle:
                    # Nothing could run (only loads in flight, or no blocks to admit with): wait
                    # for a command or a finished load rather than spin and starve the event loop.
                    self._wakeup.wait(timeout=IDLE_WAIT_S)
        except BaseException as error:
            logger.exception("engine step loop crashed")
            self._error = error
        finally:
            self._closed = True
            self._fail_all(EngineDeadError("the engine step loop has stopped"))

    def _next_step(self) -> bool:
        """The queued commands, then a step when there is anything to step; True if it stepped."""
        if self._drain_commands():
            # Before the step, which can take seconds: what the commands added (no longer counted
            # as queued) or freed shows in the report meanwhile.
            self.core.publish_load_report()
        if not self.core.has_unfinished_requests():
            return False
        outputs = self.core.step()
        # Before the outputs go out: a caller who has seen them sees a report at least as new.
        self.core.publish_load_report()
        if outputs and self._loop is not None:  # set by start(), before this thread runs
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        return True

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
        error=later.error,
        timing=later.timing or earlier.timing,
        step=later.step or earlier.step,
    )
