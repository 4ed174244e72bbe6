"""The engine's step, tokens in and tokens out: apply messages, plan, schedule, execute, update.

One step, in call order (:meth:`EngineCore.step`):

1. ``_apply_messages``: what other threads sent since the last step (engine/inbox.py): new
   requests, aborts, KV releases, finished KV loads; then the load report is published.
2. ``_plan``: drafts each decoding request wants verified (speculative decoding) and the
   prompt-chunk cap measured from the prefill rate.
3. ``_dispatch``: ``scheduler.schedule()`` says which requests run, how many tokens each
   (engine/scheduler.py), and the model runner starts the batch.
4. ``_complete_oldest``: the model runner finishes the oldest batch started; the step's
   statistics are recorded.
5. ``_update``: the scheduler advances that batch's requests by what was sampled; one output
   per request that advanced or ended; the load report is published again.

Without pipeline parallelism a step dispatches one batch and completes it. With P pipeline
stages up to P batches are in flight (vLLM v1's batch queue): a step dispatches a batch of
requests that are in none of them, and completes the oldest only once P are in flight (or
nothing more could be dispatched), so the first stages compute the next batch while this
process computes the last stage of the one before.

Only the thread that steps the engine changes its state (engine/step_thread.py): an
:class:`~engine.async_engine.AsyncEngine` claims it for its step thread, and everything else
reaches the engine through :attr:`EngineCore.inbox`. A decode engine computes phase 4 on a
model thread of its own while the step thread waits for it: a hand-off that arrives meanwhile
is added and its KV load started then (``_admit_arriving_handoffs``), so the load runs beside
this step rather than the next; every other message waits for the boundary. No tokenizer
lives here (prefill and decode services speak token ids); the offline :class:`engine.llm.LLM`
and the gateway add text on top.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.context_length import resolve_max_tokens
from engine.default_model import LoadFormat, embedded_model
from engine.gguf_files import is_gguf, metadata_folder
from engine.inbox import AbortRequests, AddRequest, EngineInbox, EngineMessage, KVLoadFinished, ReleaseKV
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventLog
from engine.kv_loader import KVLoader, KVLoadFailurePolicy
from engine.load_report import EngineLoad, PrefillRate
from engine.model_runner import ModelRunner
from engine.outputs import EngineCoreOutput
from engine.prefill_chunk import auto_long_prefill_threshold
from engine.request import Request, RequestStatus
from engine.request_timing import PromptChunk, StepStats
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelOutput, PendingStep, SchedulerOutput
from engine.spec_decode.ngram import NgramProposer
from engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How the log names what proposes drafts, by speculative method (n-gram: its own line).
_DRAFTERS = {"medusa": "Medusa heads", "eagle": "EAGLE draft", "eagle3": "EAGLE-3 draft"}

# The step thread, waiting for its model thread, looks at the inbox at least this often even if
# nothing wakes it (the model's end and every message wake it at once).
MODEL_WAIT_S = 0.5


def resolve_model_path(
    model: str | None, load_format: LoadFormat = "auto", dtype: str = "auto", device: str = "auto"
) -> Path:
    """``model``'s path; None: the embedded model in the form ``load_format`` names, chosen by
    ``dtype`` and ``device`` for ``auto`` (engine/default_model.py)."""
    if model is None:
        return embedded_model(load_format, dtype, device)
    path = Path(model).expanduser()
    gguf = is_gguf(path)
    if not (gguf or (path / "config.json").is_file()):
        raise ValueError(
            f"--model must be a local Hugging Face folder with config.json, or a .gguf file; {path} is neither"
        )
    if load_format != "auto" and (load_format == "gguf") != gguf:
        raise ValueError(
            f"--load-format {load_format} does not match --model {path}: a .gguf file loads as gguf, a Hugging Face "
            "folder as safetensors (or leave --load-format at auto)"
        )
    return path


# Builds the runner of an engine: the real ModelRunner, or one that stands in for the model
# (a simulated instance's, simulator/runner.py).
RunnerFactory = Callable[[EngineConfig, Path], ModelRunner]


@dataclass(frozen=True, slots=True)
class _BatchInFlight:
    """A batch dispatched to the model runner and not yet completed."""

    pending: PendingStep
    dispatched_at: float  # time.monotonic(), the requests' timings' clock
    num_loads_finished: int  # KV loads applied at the boundary before it


class EngineCore:
    def __init__(self, config: EngineConfig, runner_factory: RunnerFactory = ModelRunner) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model, config.load_format, config.dtype, config.device)
        # Where config.json and the tokenizer are: the model folder, or a GGUF file's metadata
        # (derived here once, before any tensor-parallel worker would race to).
        self.metadata_path = metadata_folder(self.model_path)
        self.runner = runner_factory(config, self.model_path)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.shape.vocab_size
        self.eos_token_ids = _eos_token_ids(self.runner.hf_config, self.metadata_path)
        self.structured_output = StructuredOutputManager(self.metadata_path, self.eos_token_ids, self.vocab_size)
        self.runner.structured_output = self.structured_output
        # Bounded at a few times the pool: a gateway polling twice a second falls behind it
        # only when the whole cache turns over several times in between (it then resyncs).
        self.kv_events = KVEventLog(max_events=4 * self.runner.num_blocks + 1024)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events, config.block_hasher
        )
        if config.enable_prefix_caching:
            logger.info(
                "prefix cache: %s block hashes%s",
                config.block_hasher.name,
                ""
                if config.block_hasher.name != "xxh3"
                else " (unkeyed: fastest, but a crafted prompt could collide "
                "with another's KV; with a cluster secret, --prefix-cache-hash auto keys sha256 by it)",
            )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_batches_in_flight=config.pipeline_parallel_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            role=config.role,
            max_num_prefill_tokens=config.max_num_prefill_tokens,
            speculative=config.speculative is not None and config.role != "prefill",
            long_prefill_token_threshold=(
                None if config.long_prefill_token_threshold == "auto" else config.long_prefill_token_threshold
            ),
        )
        self.prefill_rate = PrefillRate()
        self.num_steps = 0  # steps that ran the model, since start
        self.step_seconds = 0.0  # their model time, since start (mean step time = this / num_steps)
        self.last_step_was_idle = False  # the last step had nothing to run (e.g. only loads in flight)
        # Dispatched, not yet completed, oldest first: at most one per pipeline stage.
        self._in_flight: deque[_BatchInFlight] = deque()
        self.inbox = EngineInbox()  # what other threads send the step thread (engine/inbox.py)
        # Messages taken while a step computed that wait for its boundary, in arrival order.
        self._held_messages: list[EngineMessage] = []
        # Decode role, once it has a KV loader: the thread the model computes on (module docstring).
        self._model_thread: ThreadPoolExecutor | None = None
        # Outputs of requests that ended between steps (aborted, refused, a failed load): the
        # next step returns them first.
        self._outputs_between_steps: list[EngineCoreOutput] = []
        # Speculative decoding (engine/spec_decode): the prefill role samples one token, never drafts.
        self.speculative = config.speculative if config.role != "prefill" else None
        self.ngram: NgramProposer | None = None
        if self.speculative is not None and self.speculative.method == "ngram":
            spec = self.speculative
            self.ngram = NgramProposer(spec.ngram_min, spec.ngram_max, spec.num_speculative_tokens)
        if self.speculative is not None:
            spec = self.speculative
            drafter = (
                f"n-gram lookup of {spec.ngram_min}-{spec.ngram_max} tokens"
                if self.ngram
                else f"{_DRAFTERS.get(spec.method, 'draft model')} {spec.model}"
            )
            logger.info("speculative decoding: up to %d drafts per step from %s", spec.num_speculative_tokens, drafter)
        self.published_load_report = self.load_report()

    def use_kv_loader(self, kv_loader: KVLoader) -> None:
        """Decode role: the loader that fills hand-offs' blocks (engine/kv_loader.py). Given once,
        before the first step, rather than at construction: it wraps a KV connector, which is
        built on this engine's KV cache. Its results arrive through the inbox."""
        if self.config.role != "decode":
            raise ValueError(f"only a decode engine loads KV from elsewhere; this one is {self.config.role}")
        if self.scheduler.kv_loader is not None:
            raise RuntimeError("bug: the engine already has a KV loader")
        kv_loader.bind(lambda result: self.inbox.put(KVLoadFinished(result)))
        self.scheduler.kv_loader = kv_loader
        # One thread for the engine's life: its OpenMP team is then the process's only one, as
        # the step thread's was (engine/openmp_threads.py); the step thread runs no torch.
        self._model_thread = ThreadPoolExecutor(1, "engine-model", initializer=_adopt_torch_thread_count)

    def claim_step_thread(self) -> None:
        """Called by the thread that will step this engine, before its first step: from then on
        any other thread that changes the scheduler or the block pool raises RuntimeError."""
        self.kv_cache_manager.block_pool.owner.claim()

    # ----------------------------------------------------------------- intake

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        first_token_id: int | None = None,
        kv_load_failure_policy: KVLoadFailurePolicy = "recompute",
        draft_token_ids: list[int] | None = None,
    ) -> str:
        """Queue a request; the step thread only (other threads put an ``AddRequest`` in
        :attr:`inbox`), between steps. ``first_token_id`` (decode
        role) says the prompt was prefilled elsewhere: its KV will be loaded, decoding
        continues after that token, and ``kv_load_failure_policy`` says what happens if the
        KV cannot be loaded; ``draft_token_ids``: the drafts P's Medusa heads or EAGLE draft proposed after
        that token (``KVHandoff.draft_token_ids``), verified at the first step here. Raises
        ValueError for input the engine cannot serve."""
        request_id = request_id or uuid.uuid4().hex
        max_tokens = self.validate(prompt_token_ids, params, first_token_id)
        # A cache hit when the caller compiled ahead (AsyncEngine does, off this thread).
        grammar = self.structured_output.new_state(params.structured, request_id) if params.structured else None
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt.encode() if cache_salt else b"",
            grammar=grammar,
        )
        if first_token_id is not None:
            # Advances the grammar too: P sampled this token under the same grammar.
            request.append_token(first_token_id)
            request.num_external_tokens = len(prompt_token_ids)
            request.kv_load_failure_policy = kv_load_failure_policy
            if draft_token_ids and self.speculative is not None and self.speculative.drafts_after_step:
                request.spec_token_ids = list(draft_token_ids)
        self.scheduler.add_request(request)
        return request_id

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, first_token_id: int | None = None) -> int:
        """Raise ValueError for a request this engine cannot serve; return its resolved max_tokens.
        Reads only the configuration: safe to call from any thread."""
        num_prompt = len(prompt_token_ids)
        if first_token_id is not None and self.config.role != "decode":
            raise ValueError(
                "first_token_id continues a remotely prefilled prompt: decode role only, this engine is "
                f"{self.config.role}"
            )
        if first_token_id is not None and self.scheduler.kv_loader is None:
            raise ValueError("this decode engine has no KV loader: it cannot continue a prompt prefilled elsewhere")
        if num_prompt == 0:
            raise ValueError("the prompt is empty; send at least one token")
        token_ids = prompt_token_ids if first_token_id is None else [*prompt_token_ids, first_token_id]
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        return resolve_max_tokens(num_prompt, params.max_tokens, self.max_model_len)

    # ------------------------------------------------------------------- step

    def has_unfinished_requests(self) -> bool:
        """Anything for a step to do: requests in the scheduler, messages, outputs to hand back."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.inbox)
            or bool(self._held_messages)
            or bool(self._outputs_between_steps)
            or bool(self._in_flight)
        )

    def step(self) -> list[EngineCoreOutput]:
        """Apply what arrived, schedule and start a batch, finish the oldest one, and report
        every request that advanced or ended (the phases are listed in the module docstring)."""
        num_loads_finished = self._apply_messages()
        outputs, self._outputs_between_steps = self._outputs_between_steps, []
        self._plan()
        dispatched = self._dispatch(num_loads_finished)
        completes = bool(self._in_flight) and (
            not dispatched or len(self._in_flight) == self.scheduler.max_batches_in_flight
        )
        if completes:
            outputs.extend(self._complete_oldest())
        self.last_step_was_idle = not dispatched and not completes
        # Before the outputs go out: a caller who has seen them sees a report at least as new.
        self.publish_load_report()
        return outputs

    def _apply_messages(self) -> int:
        """Step phase 1: every message in the inbox, in arrival order; the load report is
        published before their adds stop counting as queued. Returns how many KV loads finished."""
        messages, self._held_messages = self._held_messages + self.inbox.take(), []
        if not messages:
            return 0
        num_loads_finished = 0
        for message in messages:
            num_loads_finished += self._apply(message)
        self.publish_load_report()
        self.inbox.applied(messages)
        return num_loads_finished

    def _apply(self, message: EngineMessage) -> int:
        """One message; returns 1 for a finished KV load, else 0."""
        match message:
            case AddRequest():
                try:
                    self.add_request(
                        message.prompt_token_ids,
                        message.params,
                        request_id=message.request_id,
                        priority=message.priority,
                        cache_salt=message.cache_salt,
                        first_token_id=message.first_token_id,
                        kv_load_failure_policy=message.kv_load_failure_policy,
                        draft_token_ids=message.draft_token_ids,
                    )
                except ValueError as error:  # e.g. the id is still held by a pinned prefill
                    self._outputs_between_steps.append(
                        EngineCoreOutput(message.request_id, [], [], finish_reason=None, refusal=str(error))
                    )
            case AbortRequests():
                self.abort(list(message.request_ids))
            case ReleaseKV():
                self.release_kv(message.request_id)
            case KVLoadFinished():
                if (ended := self.scheduler.kv_load_finished(message.result)) is not None:
                    self._outputs_between_steps.append(self._output(ended, new_token_ids=[]))
                return 1
        return 0

    def _plan(self) -> None:
        """Step phase 2: what the scheduler needs to know before it schedules."""
        if self.speculative is not None:
            self._plan_drafts()
        if self.config.long_prefill_token_threshold == "auto":
            self._size_prefill_chunks()

    def _dispatch(self, num_loads_finished: int) -> bool:
        """Step phase 3: schedule a batch and start it, where the pipeline has room for one;
        False when nothing was dispatched."""
        if len(self._in_flight) == self.scheduler.max_batches_in_flight:
            return False
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return False
        started = time.monotonic()  # the requests' timings use this clock (engine/request_timing.py)
        self._in_flight.append(_BatchInFlight(self.runner.dispatch(scheduler_output), started, num_loads_finished))
        return True

    def _complete_oldest(self) -> list[EngineCoreOutput]:
        """Step phases 4 and 5: finish the oldest batch in flight and update its requests."""
        batch = self._in_flight.popleft()
        model_output = self._compute(batch.pending)
        step = self._record_step(batch, time.monotonic())
        return self._update(batch.pending.output, model_output, step)

    def _record_step(self, batch: _BatchInFlight, ended: float) -> StepStats:
        """The completed batch's statistics, and its prompt chunks' times on their requests."""
        scheduler_output, started = batch.pending.output, batch.dispatched_at
        seconds = ended - started
        num_prefill_tokens = (
            scheduler_output.num_scheduled_tokens - scheduler_output.num_decodes - scheduler_output.num_spec_tokens
        )
        self.prefill_rate.add(num_prefill_tokens, seconds)
        self.num_steps += 1
        self.step_seconds += seconds
        # Prompt chunks come last in the schedule, after decodes and speculative decodes.
        num_decodes = scheduler_output.num_decodes + scheduler_output.num_spec_decodes
        for item in scheduler_output.scheduled[num_decodes:]:
            item.request.timing.prompt_chunks.append(
                PromptChunk(started, ended, item.num_new_tokens, scheduler_output.num_scheduled_tokens)
            )
        return StepStats(
            started_at=started,
            ended_at=ended,
            num_rows=len(scheduler_output.scheduled),
            num_decodes=num_decodes,
            num_prefill_tokens=num_prefill_tokens,
            num_preempted=len(scheduler_output.preempted_request_ids),
            num_loads_finished=batch.num_loads_finished,
        )

    def _compute(self, pending: PendingStep) -> ModelOutput:
        """The rest of the model's pass over a dispatched batch. A decode engine runs it on its
        model thread and admits the hand-offs that arrive until it ends."""
        if self._model_thread is None:
            return self.runner.complete(pending, self.eos_token_ids)
        computing = self._model_thread.submit(self.runner.complete, pending, self.eos_token_ids)
        computing.add_done_callback(lambda _: self.inbox.wake())
        while True:
            self.inbox.clear_wakeup()  # before looking: a message or the model's end from now on wakes the wait
            if computing.done():
                return computing.result()
            self._admit_arriving_handoffs()
            self.inbox.wait(MODEL_WAIT_S)

    def _admit_arriving_handoffs(self) -> None:
        """While the model computes: add the hand-offs that arrived and start the loads of those
        the scheduler admits now (engine/scheduler.py ``admit_handoffs``). The running batch is
        not touched: a hand-off takes free blocks only, and its request joins the running ones
        at a boundary, when its load has finished. Every other message, and a hand-off named by
        one held before it (an abort that came first), waits for the boundary in arrival order."""
        messages = self.inbox.take()
        if not messages:
            return
        added: list[EngineMessage] = []
        held_ids = {request_id for held in self._held_messages for request_id in _request_ids(held)}
        for message in messages:
            if (
                isinstance(message, AddRequest)
                and message.first_token_id is not None
                # Compiled grammars are shared with the model thread's bitmask filling.
                and message.params.structured is None
                and message.request_id not in held_ids
            ):
                self._apply(message)
                added.append(message)
            else:
                self._held_messages.append(message)
                held_ids.update(_request_ids(message))
        if added:
            self.scheduler.admit_handoffs()
            self.publish_load_report()
            self.inbox.applied(added)

    def _update(
        self, scheduler_output: SchedulerOutput, model_output: ModelOutput, step: StepStats
    ) -> list[EngineCoreOutput]:
        """Step phase 5: advance the requests by what the step sampled; one output each."""
        outputs = []
        for request, num_new_tokens in self.scheduler.update(scheduler_output, model_output):
            timing = request.timing
            if timing.first_token_at is None:
                timing.first_token_step_started_at, timing.first_token_at = step.started_at, step.ended_at
            outputs.append(self._output(request, new_token_ids=request.all_token_ids[-num_new_tokens:], step=step))
        return outputs

    def _size_prefill_chunks(self) -> None:
        """The "auto" cap on one request's prompt chunk, from the prefill rate measured so far."""
        threshold = auto_long_prefill_threshold(
            self.prefill_rate.tokens_per_s, self.config.block_size, self.config.max_num_batched_tokens
        )
        if threshold != self.scheduler.long_prefill_token_threshold:
            # DEBUG: the measured rate drifts, and the cap with it by a block now and then.
            logger.debug("long prompts now prefill in chunks of %s tokens", threshold or "unlimited")
            self.scheduler.long_prefill_token_threshold = threshold

    def _plan_drafts(self) -> None:
        """Say how many drafts each running request that decodes wants verified next step
        (n-gram: which ones, too). Prefill chunks, and requests whose parameters rule
        speculation out, draft nothing."""
        num_speculative_tokens = self.speculative.num_speculative_tokens if self.speculative else 0
        running = self.scheduler.running
        turned_down = self.speculative is not None and not self.speculative.speculates_at(len(running))
        for request in running:
            if (
                turned_down
                or request.num_tokens - request.num_computed_tokens != 1
                or not request.sampling_params.can_speculate
            ):
                request.num_spec_tokens = 0
            elif self.ngram is not None:
                request.spec_token_ids = self.ngram.propose(request.all_token_ids)
                request.num_spec_tokens = len(request.spec_token_ids)
            elif self.speculative is not None and self.speculative.drafts_after_step:
                # Proposed after the request's last step (engine/spec_decode/medusa.py, eagle.py).
                request.num_spec_tokens = len(request.spec_token_ids)
            else:
                request.num_spec_tokens = num_speculative_tokens

    def _output(self, request: Request, new_token_ids: list[int], step: StepStats | None = None) -> EngineCoreOutput:
        handoff = None
        if request.status is RequestStatus.FINISHED_PREFILLED:
            handoff = self.scheduler.kv_handoff(request)
            # The EAGLE (or EAGLE-3) draft's KV over the prompt crosses with it.
            if self.runner.eagle is not None:
                handoff.prompt_draft_kv = self.runner.eagle.export_prompt(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=request.logprobs[-len(new_token_ids) :] if request.logprobs and new_token_ids else [],
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            kv_handoff=handoff,
            error=request.error,
            timing=request.timing,
            step=step,
            num_spec_draft_tokens=request.num_spec_draft_tokens,
            num_spec_accepted_tokens=request.num_spec_accepted_tokens,
        )

    # -------------------------------------------------------- ending requests

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests now and free their blocks (pinned prefill KV included).
        The next :meth:`step` reports them finished with reason ``abort``."""
        for request in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._outputs_between_steps.append(self._output(request, new_token_ids=[]))

    def finish_with_stop_string(self, request_id: str, stop_string: str) -> None:
        """A stop string matched in the detokenized text (seen only above this layer)."""
        for request in self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED):
            request.stop_reason = stop_string

    def release_kv(self, request_id: str) -> bool:
        """Prefill role: the decode side has the KV (or gave up on it); unpin the blocks.
        Returns False when nothing was pinned under that id (already released, or expired)."""
        if request_id not in self.scheduler.pinned:
            return False
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_RELEASED)
        return True

    def close(self) -> None:
        """Release what outlives a process's garbage collection: the tensor-parallel worker
        processes, if any, and the model thread. The engine takes no step after it."""
        if self._model_thread is not None:
            self._model_thread.shutdown()
        self.runner.close()

    # ------------------------------------------------------------ observation

    def publish_load_report(self) -> None:
        """Take the load now as :attr:`published_load_report`, which other threads read without
        waiting for a step (the step thread, after it applied messages and after each step)."""
        self.published_load_report = self.load_report()

    def load_report(self) -> EngineLoad:
        return EngineLoad(
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.kv_cache_manager.num_total_blocks,
            prefix_cache_hit_rate=self.kv_cache_manager.block_pool.prefix_cache_hit_rate,
            num_pending_prefill_tokens=self.scheduler.num_pending_prefill_tokens,
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            num_spec_draft_tokens=self.scheduler.spec_stats.num_draft_tokens,
            num_spec_accepted_tokens=self.scheduler.spec_stats.num_accepted_tokens,
            num_spec_draft_tokens_per_pos=tuple(self.scheduler.spec_stats.num_drafts_at),
            num_spec_accepted_tokens_per_pos=tuple(self.scheduler.spec_stats.num_accepted_at),
            num_spec_verifications_by_accepted=tuple(self.scheduler.spec_stats.accepted_length_counts),
        )


def _request_ids(message: EngineMessage) -> tuple[str, ...]:
    match message:
        case AbortRequests():
            return message.request_ids
        case KVLoadFinished():
            return (message.result.request_id,)
        case _:
            return (message.request_id,)


def _adopt_torch_thread_count() -> None:
    """On a new thread that will run the model: torch's first use on a thread sets its OpenMP
    thread count to the process's (``torch.set_num_threads``); done here so that native kernels
    running before any torch op get the same count. A simulated engine runs no torch."""
    if "torch" in sys.modules:
        sys.modules["torch"].get_num_threads()


def _eos_token_ids(hf_config: object, model_path: Path) -> frozenset[int]:
    """EOS ids from generation_config.json when present (it may list several), else config.json."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
    except OSError:
        eos = None
    for value in (eos, getattr(hf_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return frozenset(ids)
