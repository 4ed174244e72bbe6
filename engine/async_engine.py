"""The engine behind an asyncio API: services add requests, stream their outputs, abort them.

The step loop runs on a dedicated thread (torch releases the GIL in its kernels, so the
event loop stays responsive), the only thread that changes engine state. Everything else
sends it a typed message through the engine's inbox (engine/inbox.py), which it applies at
the next step boundary.

Nothing on the event loop waits for a step: a prefill step can take seconds, and control
calls (abort, release, load reports, health) must answer in milliseconds whatever the engine
is doing. So :meth:`AsyncEngine.abort` and :meth:`AsyncEngine.release_kv` only post their
message, :meth:`AsyncEngine.generate` validates on the caller's thread and posts the
request, and load reports come from the snapshot the engine publishes at each step, plus
the adds still in the inbox.

A request's path, in call order:

1. ``generate()`` (event loop): validate, open the request's stream, post ``AddRequest``.
2. Step thread, ``EngineCore.step()``: the inbox's messages (the add; for a decode hand-off
   the scheduler then starts its KV load when it admits it, and the loader posts
   ``KVLoadFinished`` when done, for a later step), then schedule and run the model. Its
   outputs go to the event loop with ``call_soon_threadsafe``.
3. Event loop: ``_dispatch`` puts each output into its request's stream; ``generate()``
   yields it.
4. A consumer that stops early, ``abort()`` or ``release_kv()``: a message, applied at the
   next step boundary, freeing the request's blocks exactly once.

A hand-off that arrives while a step computes waits for that step to end; its load then
runs during the next step, and it decodes in the step after that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator
from threading import Thread

from engine.config import EngineConfig
from engine.engine_core import EngineCore, RunnerFactory
from engine.inbox import AbortRequests, AddRequest, ReleaseKV
from engine.kv_loader import KVLoader, KVLoadFailurePolicy
from engine.load_report import EngineLoad
from engine.model_runner import ModelRunner
from engine.openmp_threads import run_in_passing_thread
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle engine thread looks again this often even if nothing wakes it


class EngineDeadError(RuntimeError):
    """The step loop crashed; every in-flight request gets this."""


class AsyncEngine:
    """Owns an :class:`EngineCore` and its thread. Use as ``async with AsyncEngine(config) as engine``."""

    def __init__(self, config: EngineConfig, runner_factory: RunnerFactory = ModelRunner) -> None:
        # Loaded on a thread that ends: the step thread's OpenMP team is then the process's
        # only one, and its workers spin between a step's parallel regions (engine/openmp_threads.py).
        # Not with tensor- or pipeline-parallel workers: they die with the thread that started
        # them (PR_SET_PDEATHSIG follows the parent thread, not the process).
        if config.world_size == 1:
            self.core = run_in_passing_thread(lambda: EngineCore(config, runner_factory), name="engine-load")
        else:
            self.core = EngineCore(config, runner_factory)
        self._streams: dict[str, asyncio.Queue[EngineCoreOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: Thread | None = None
        self._stopping = False
        self._closed = False  # the step loop has exited: messages would never be applied
        self._error: BaseException | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self, kv_loader: KVLoader | None = None) -> None:
        """Start the step loop. ``kv_loader`` (decode role): what fills hand-offs' blocks; it
        comes at start, not construction, because it wraps a connector built on this engine's
        KV cache."""
        if kv_loader is not None:
            self.core.use_kv_loader(kv_loader)
        self._loop = asyncio.get_running_loop()
        self._thread = Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the step loop; requests still in flight end with :class:`EngineDeadError`."""
        self._stopping = True
        self.core.inbox.wake()
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
        draft_token_ids: list[int] | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Stream a request's outputs as the engine produces them, until it finishes.

        ``first_token_id`` (decode role): the prompt was prefilled elsewhere and its KV is
        loaded here; ``kv_load_failure_policy`` says what happens if it cannot be (``fail``:
        the stream ends with finish reason "error"); ``draft_token_ids``: the prefill
        instance's Medusa drafts after that token, verified at the first step here. Raises ValueError (before anything
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
        # The engine refuses a duplicate id too, but only when it applies the add; a stream
        # cancelled before that refusal arrives would then abort the id's other holder (a
        # prefill still pinned under it). Checked here first, the refusal is near certain to
        # come before anything is queued (the scheduler's dict is read, never written, here).
        if request_id in self._streams or request_id in self.core.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
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
        self.core.inbox.put(
            AddRequest(
                request_id,
                list(prompt_token_ids),
                params,
                priority=priority,
                cache_salt=cache_salt,
                first_token_id=first_token_id,
                kv_load_failure_policy=kv_load_failure_policy,
                num_prefill_tokens=num_prefill_tokens,
                draft_token_ids=draft_token_ids,
            )
        )
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.refusal is not None:
                    finished = True  # nothing was added: nothing to abort
                    raise ValueError(item.refusal)
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
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary, freeing its blocks (pinned prefill KV too;
        a hand-off's once its load has stopped). Returns at once; unknown or finished ids are
        ignored."""
        self.core.inbox.put(AbortRequests((request_id,)))

    def release_kv(self, request_id: str) -> None:
        """Prefill role: unpin a handed-off request's blocks at the next step boundary.
        Returns at once; a second release of the same id does nothing."""
        self.core.inbox.put(ReleaseKV(request_id))

    def latest_load_report(self) -> EngineLoad:
        """The load as of the latest step, at once, plus the requests still in the inbox. Health
        and routing polls use this: a long prefill step takes seconds, an instance busy with one
        is not unhealthy, and what arrived during it is queued."""
        report = self.core.published_load_report
        num_adds, num_tokens = self.core.inbox.queued_adds()
        if not num_adds:
            return report
        return dataclasses.replace(
            report,
            num_waiting=report.num_waiting + num_adds,
            num_pending_prefill_tokens=report.num_pending_prefill_tokens + num_tokens,
        )

    # ------------------------------------------------------------ the step thread

    def _run(self) -> None:
        self.core.claim_step_thread()
        inbox = self.core.inbox
        try:
            while not self._stopping:
                # Cleared before looking for work: a message from now on is never missed.
                inbox.clear_wakeup()
                stepped = self.core.has_unfinished_requests()
                if stepped:
                    outputs = self.core.step()
                    self.core.kv_events.end_step()  # the step's prefix-cache changes, as one batch
                    if outputs and self._loop is not None:  # set by start(), before this thread runs
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)
                if not stepped or self.core.last_step_was_idle:
                    # Nothing could run (only loads in flight, or no blocks to admit with): wait
                    # for a message rather than spin and starve the event loop.
                    inbox.wait(IDLE_WAIT_S)
        except BaseException as error:
            logger.exception("engine step loop crashed")
            self._error = error
        finally:
            self._closed = True
            self._fail_all(EngineDeadError("the engine step loop has stopped"))

    # ------------------------------------------------------------ the event loop's side

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
        num_spec_draft_tokens=later.num_spec_draft_tokens,
        num_spec_accepted_tokens=later.num_spec_accepted_tokens,
    )
