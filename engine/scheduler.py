"""Continuous batching: which requests run in the next step, and how many tokens each.

One step has one token budget (``max_num_batched_tokens``) and a cap on
sequences (``max_num_seqs``). Running requests go first — a decode costs one
token, an unfinished prefill continues with as large a chunk as the budget
allows — then waiting requests are admitted in priority order (FCFS when no
priorities are given), with their prompts chunked to fit. When blocks run
out, the lowest-priority, latest-arrived running request is preempted: its
blocks are freed and it later recomputes prompt plus output, losing nothing.

A waiting prompt whose prefix-cache hit stops at a block that a prefill under way is about
to compute (two requests with one system prompt, arriving close together) waits for that
block instead of computing the shared prefix a second time beside it; the requests behind
it are admitted meanwhile (``_prompt_blocks_in_flight``).

A decoding request with drafts (speculative decoding, engine/spec_decode) costs one token
plus its drafts; drafts are only scheduled where their slots fit without preempting anyone,
and after the step the rejected ones are rolled back (``_update_spec``).

``max_num_prefill_tokens`` caps the prompt (and recompute) tokens of one step
beside its decodes: the decode role sets it so that a prompt it must compute
itself (a failed pull, a preempted request) costs running streams at most one
chunk's worth of delay per step, never a whole prompt's.

``long_prefill_token_threshold`` (vLLM's name and meaning) caps the chunk of any one
request in a step, so a long prompt no longer takes a whole step to itself: a short
prompt that arrives meanwhile waits for at most one capped chunk, then shares the next
step with the long prompt's following chunk (docs/benchmarks.md, "Prompt chunks capped on
the prefill instance").

Decode role: a hand-off (a prompt prefilled elsewhere) is admitted without token budget: its
blocks are allocated and its :class:`~engine.kv_loader.KVLoader` asked to fill them; the
loader's results reach the scheduler at a step boundary (:meth:`Scheduler.kv_load_finished`).
A hand-off that arrives while a step computes is admitted then (:meth:`admit_handoffs`), when
its blocks leave the running requests what their next step may take.

Pipeline parallelism keeps up to ``max_batches_in_flight`` batches in the pipeline (vLLM v1's
batch queue): ``schedule()`` runs again before the batches it returned earlier are updated, and
passes over the requests still in one (``in_flight``: their next token is not known yet); each
batch takes at most its share of the requests, so that the batches in flight are about the same
size. A request that ends while in flight (aborted) keeps its blocks until its batch is updated:
the stages may still be writing its KV.

Only the engine's step thread calls the methods that change the scheduler (they check it:
engine/step_thread.py); everything from other threads reaches it through the engine's inbox.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable

from engine.config import EngineRole
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_utils import BlockHash, cdiv
from engine.kv_loader import KVLoad, KVLoader, KVLoadResult
from engine.outputs import KVHandoff
from engine.request import Request, RequestStatus
from engine.scheduler_output import ModelOutput, ScheduledRequest, SchedulerOutput
from engine.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


def _admission_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        role: EngineRole = "colocated",
        max_num_prefill_tokens: int | None = None,
        speculative: bool = False,
        long_prefill_token_threshold: int | None = None,
        max_batches_in_flight: int = 1,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.speculative = speculative  # drafts may be scheduled (off: no per-step cost at all)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_prefill_tokens = max_num_prefill_tokens or max_num_batched_tokens
        # The most prompt (or recompute) tokens of one request in one step; None: no cap of its own.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.role = role
        self.max_batches_in_flight = max_batches_in_flight
        # Requests in a batch that schedule() returned and update() has not applied yet.
        self.in_flight: set[str] = set()
        self.requests: dict[str, Request] = {}  # every request that holds or awaits resources
        self.waiting: list[Request] = []  # sorted by (priority, arrival time)
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}  # decode role: prompt KV being loaded
        # Decode role: requests ended while their load was in flight, holding their blocks until
        # the loader reports that nothing writes into them any more.
        self.cancelled_loads: dict[str, Request] = {}
        self.kv_loader: KVLoader | None = None  # decode role: set by the engine before its first step
        self.pinned: dict[str, Request] = {}  # prefill role: KV kept for the decode side
        self.owner = kv_cache_manager.block_pool.owner  # the step thread, once it claims the engine
        self.num_preemptions = 0  # since start, for metrics and tests
        self.spec_stats = SpecDecodeStats()  # drafts verified and accepted, since start

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        self.owner.check()
        if request.request_id in self.requests or request.request_id in self.cancelled_loads:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_external_tokens and self.kv_loader is None:
            raise ValueError("this engine has no KV loader: it cannot continue a prompt prefilled elsewhere")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_admission_key)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string, KV release). Frees their blocks
        at once. Unknown or already finished ids are ignored. Returns the requests ended."""
        self.owner.check()
        ended = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(request)
            elif request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.FINISHED_PREFILLED:
                del self.pinned[request_id]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                # Its load may still write into its blocks: they are freed when the loader says it stopped.
                del self.waiting_for_kv[request_id]
                self.cancelled_loads[request_id] = request
                if self.kv_loader is None:
                    raise RuntimeError(f"bug: {request_id} waited for its KV on an engine without a KV loader")
                self.kv_loader.cancel_load(request_id)
            elif request_id not in self.in_flight:  # else freed when its batch is updated
                self.kv_cache_manager.free(request)
            request.status = status
            ended.append(request)
        return ended

    def kv_load_finished(self, result: KVLoadResult) -> Request | None:
        """Decode role, at a step boundary: apply a load the loader reported finished.

        A loaded request joins the decode loop. A failed one recomputes the part of its prompt
        the local prefix cache did not hold, in chunks of at most ``max_num_prefill_tokens`` per
        step, or ends with FINISHED_ERROR, as its ``kv_load_failure_policy`` says; a hand-off
        still waiting for blocks whose source is gone does the same without taking any. Either
        way the KV is local from then on: a later preemption recomputes here and never loads
        again from a prefill instance that has released it. The blocks of a request aborted
        during its load are freed here. Returns the request if it ended (with FINISHED_ERROR);
        a result for an unknown request (a repeat, or one that ended meanwhile) changes nothing."""
        self.owner.check()
        if (cancelled := self.cancelled_loads.pop(result.request_id, None)) is not None:
            self.kv_cache_manager.free(cancelled)
        elif (request := self.waiting_for_kv.pop(result.request_id, None)) is not None:
            if self._kv_loaded(request, result):
                self.running.append(request)
            else:
                return request
        elif (request := self.requests.get(result.request_id)) is not None and request.num_external_tokens:
            # Not admitted yet (waiting for blocks): only a failure can be reported for it.
            if result.error is None:
                raise RuntimeError(f"bug: the KV loader reported a load of {request.request_id} it never started")
            if request.kv_load_failure_policy == "recompute":
                request.num_external_tokens = 0  # an ordinary prompt from now on, prefilled here when admitted
            else:
                self.waiting.remove(request)
                self._end_with_error(request, result.error)
                return request
        return None

    def _kv_loaded(self, request: Request, result: KVLoadResult) -> bool:
        """A request whose blocks the loader no longer writes: True when it runs from now on,
        False when it ended (its blocks freed)."""
        request.timing.kv_loaded_at = time.monotonic()
        if result.error is None:
            request.num_computed_tokens = request.num_external_tokens
            request.prompt_draft_kv = result.prompt_draft_kv
            self.kv_cache_manager.cache_blocks(request, request.num_external_tokens)
        elif request.kv_load_failure_policy == "fail":
            self.kv_cache_manager.free(request)
            self._end_with_error(request, result.error)
            return False
        else:
            logger.warning("KV of %s could not be loaded, recomputing it here: %s", request.request_id, result.error)
        request.num_external_tokens = 0
        request.status = RequestStatus.RUNNING
        return True

    def _end_with_error(self, request: Request, error: str) -> None:
        del self.requests[request.request_id]
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_kv)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens still to compute: what a new prompt would queue behind.
        A waiting request's prefix-cache hit counts as already computed (estimated from the
        cache now): counted in full, a queue of requests sharing a cached system prompt looked
        like a queue of whole prompts, and cache-aware routing sent the next one elsewhere."""
        waiting = sum(
            r.num_tokens
            - r.num_computed_tokens
            - (self.kv_cache_manager.num_cached_prefix_tokens(r) if not r.num_computed_tokens else 0)
            for r in self.waiting
            if not r.num_external_tokens
        )
        return waiting + sum(_num_prefill_tokens_left(r) for r in self.running)

    def has_unfinished_requests(self) -> bool:
        """Anything left for steps to do, including freeing the blocks of cancelled loads."""
        return bool(self.waiting or self.running or self.waiting_for_kv or self.cancelled_loads)

    # --------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        self.owner.check()
        budget = self.max_num_batched_tokens
        prefill_budget = self.max_num_prefill_tokens  # of ``budget``, for prompt and recompute chunks
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        kv = self.kv_cache_manager
        max_rows = self._max_rows()

        for request in list(self.running):
            if budget == 0 or len(scheduled) >= max_rows:
                break
            if request.status is not RequestStatus.RUNNING or request.request_id in self.in_flight:
                continue  # preempted earlier in this loop, or its next token is not known yet
            num_new_tokens = self._chunk(request.num_tokens - request.num_computed_tokens, budget, prefill_budget)
            if num_new_tokens == 0:
                continue  # a prefill, and this step's prefill budget is spent
            while kv.allocate_slots(request, num_new_tokens) is None:
                # A request in flight keeps its blocks: its KV is being written.
                victim = max((r for r in self.running if r.request_id not in self.in_flight), key=_admission_key)
                num_given_back = self._preempt(victim, scheduled)
                budget += num_given_back
                if num_given_back > 1:
                    prefill_budget += num_given_back
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._scheduled(request, num_new_tokens)
                budget -= num_new_tokens
                if num_new_tokens > 1:
                    prefill_budget -= num_new_tokens

        # Drafts come after every running request has its one token: they only take what is
        # left, never a block another stream needs (that would preempt it).
        if self.speculative and not preempted:
            budget -= self._schedule_drafts(scheduled, budget)

        # Admitting more work in a step that had to preempt would only thrash.
        blocks_in_flight = self._prompt_blocks_in_flight() if self.waiting and not preempted else set()
        num_held = 0  # waiting prompts passed over this step: their next block is in flight
        while len(self.waiting) > num_held and budget > 0 and not preempted:
            if len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs or len(scheduled) >= max_rows:
                break
            request = self.waiting[num_held]
            if request.num_external_tokens:
                if not self._admit_handoff(request):
                    break
                continue
            if blocks_in_flight and kv.first_uncached_block_hash(request) in blocks_in_flight:
                num_held += 1
                continue
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = self._chunk(request.num_tokens - num_hit_tokens, budget, prefill_budget)
            if num_new_tokens == 0 or kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                break
            self.waiting.pop(num_held)
            blocks_in_flight.update(kv.blocks_still_to_cache(request))
            request.num_computed_tokens = num_hit_tokens
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            if request.timing.first_scheduled_at is None:
                request.timing.first_scheduled_at = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = self._scheduled(request, num_new_tokens)
            budget -= num_new_tokens
            if num_new_tokens > 1:
                prefill_budget -= num_new_tokens

        # Decodes first: backends batch all single-token queries in one call.
        if self.max_batches_in_flight > 1:  # one batch at a time is updated before the next is scheduled
            self.in_flight.update(scheduled)
        decodes = [s for s in scheduled.values() if s.num_new_tokens == 1]
        spec_decodes = [s for s in scheduled.values() if s.num_draft_tokens] if self.speculative else []
        prefills = [s for s in scheduled.values() if s.num_new_tokens != 1 and not s.num_draft_tokens]
        return SchedulerOutput(
            scheduled=decodes + spec_decodes + prefills,
            num_decodes=len(decodes),
            num_scheduled_tokens=self.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
            num_spec_decodes=len(spec_decodes),
            num_spec_tokens=sum(s.num_new_tokens for s in spec_decodes),
        )

    def _max_rows(self) -> int:
        """The most requests one batch takes: with several batches in flight, its share of all
        that could run (so that they take turns in equal batches rather than one batch holding
        everyone and the next nobody); otherwise no cap of its own."""
        if self.max_batches_in_flight == 1:
            return self.max_num_seqs
        return max(1, cdiv(len(self.running) + len(self.waiting), self.max_batches_in_flight))

    def _prompt_blocks_in_flight(self) -> set[BlockHash]:
        """Prompt blocks that prefills under way have still to compute. A waiting prompt whose
        next block (where its prefix-cache hit stops) is one of them is held back until that
        block is computed: admitted now, it would compute the rest of the shared prefix a
        second time beside the prefill that is computing it, and leave only one copy cached.
        Held, it hits the prefix a step or a few later and computes only its own blocks."""
        return {
            block_hash
            for request in self.running
            if _num_prefill_tokens_left(request)
            for block_hash in self.kv_cache_manager.blocks_still_to_cache(request)
        }

    def admit_handoffs(self) -> int:
        """Decode role, while a step computes: admit the hand-offs at the head of the queue as
        the next ``schedule()`` would, so that their loads start now. Only while the blocks they
        may take leave every running request the blocks its next step may need: admitted now, a
        hand-off must never cause a preemption that admitting it at the boundary (after the
        running requests' blocks) would not have. Returns how many were admitted."""
        self.owner.check()
        kv = self.kv_cache_manager
        num_admitted = 0
        while self.waiting and self.waiting[0].num_external_tokens:
            request = self.waiting[0]
            if len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs:
                break
            # At most all of its blocks: the local prefix cache's hits only lower it.
            if kv.num_free_blocks - cdiv(request.num_tokens, kv.block_size) < self._next_step_blocks():
                break
            if not self._admit_handoff(request):
                break
            num_admitted += 1
        return num_admitted

    def _next_step_blocks(self) -> int:
        """The most new blocks the running requests may take at the next step: a block for each
        one's next token, and the blocks of the prompt chunks still to compute."""
        block_size = self.kv_cache_manager.block_size
        return len(self.running) + sum(
            cdiv(min(_num_prefill_tokens_left(request), self.max_num_prefill_tokens), block_size)
            for request in self.running
        )

    def _admit_handoff(self, request: Request) -> bool:
        """Blocks for the head of the queue, a hand-off, and the load that fills the ones the
        local prefix cache does not hold; False (nothing changed) when they do not fit."""
        kv = self.kv_cache_manager
        if self.kv_loader is None:
            raise RuntimeError(f"bug: hand-off {request.request_id} queued on an engine without a KV loader")
        computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        num_new_tokens = request.num_external_tokens - num_hit_tokens
        if kv.allocate_slots(request, num_new_tokens, computed_blocks, cache_new_blocks=False) is None:
            return False
        self.waiting.remove(request)  # the head, or the first after prompts held for a block in flight
        request.num_computed_tokens = request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.timing.kv_load_started_at = request.timing.first_scheduled_at = time.monotonic()
        self.waiting_for_kv[request.request_id] = request
        self.kv_loader.start_load(
            KVLoad(request.request_id, list(kv.get_block_ids(request.request_id)), len(computed_blocks))
        )
        return True

    def update(self, output: SchedulerOutput, model_output: ModelOutput) -> list[tuple[Request, int]]:
        """Advance every scheduled request by what the step computed and sampled.

        Returns the requests that got new tokens this step (finished or not), in
        schedule order, each with how many (more than one only for accepted drafts).
        Finished requests have released their blocks, except the prefill role's, whose
        blocks stay pinned until :meth:`finish_requests`.
        """
        self.owner.check()
        updated: list[tuple[Request, int]] = []
        finished: list[Request] = []
        sample_index = 0
        for item in output.scheduled:
            request = item.request
            self.in_flight.discard(request.request_id)
            if request.status.is_finished and request.request_id not in self.requests:
                # Ended while its batch was in flight (aborted): nothing writes its blocks now.
                self.kv_cache_manager.free(request)
                sample_index += item.samples
                continue
            request.num_computed_tokens += item.num_new_tokens
            if not item.samples:
                continue
            token_id = model_output.sampled_token_ids[sample_index]
            logprobs = model_output.logprobs[sample_index]
            sample_index += 1
            if item.num_draft_tokens:
                num_added = self._update_spec(request, item.num_draft_tokens, model_output, sample_index - 1)
            else:
                num_added = 1
                request.append_token(token_id)
                if logprobs is not None:
                    request.logprobs.append(logprobs)
                self._check_stop(request, token_id)
            if model_output.draft_token_ids is not None:  # Medusa: what the next step verifies
                request.spec_token_ids = model_output.draft_token_ids[sample_index - 1]
            if not request.status.is_finished and self.role == "prefill":
                request.status = RequestStatus.FINISHED_PREFILLED
            updated.append((request, num_added))
            if request.status.is_finished:
                finished.append(request)
        if finished:
            finished_ids = {request.request_id for request in finished}
            self.running = [request for request in self.running if request.request_id not in finished_ids]
            for request in finished:
                if request.status is RequestStatus.FINISHED_PREFILLED:
                    self.pinned[request.request_id] = request
                else:
                    del self.requests[request.request_id]
                    self.kv_cache_manager.free(request)
        return updated

    def _update_spec(self, request: Request, num_drafts: int, model_output: ModelOutput, index: int) -> int:
        """Append a speculating request's accepted drafts and its bonus/recovered token (stopping
        where a stop condition hits); roll its computed tokens back past the rejected drafts and
        free the blocks that held only those. Returns how many tokens were appended."""
        if model_output.accepted_token_ids is None or model_output.accepted_logprobs is None:
            raise RuntimeError("bug: a step that verified drafts returned no accepted tokens")
        accepted = model_output.accepted_token_ids[index]
        # KV written for rejected drafts is simply not counted: the next step overwrites those slots.
        request.num_computed_tokens -= num_drafts - len(accepted)
        self.spec_stats.add(num_drafts, len(accepted))
        request.num_spec_draft_tokens += num_drafts
        request.num_spec_accepted_tokens += len(accepted)
        token_ids = [*accepted, model_output.sampled_token_ids[index]]
        logprobs = [*model_output.accepted_logprobs[index], model_output.logprobs[index]]
        num_added = 0
        for token_id, token_logprobs in zip(token_ids, logprobs):
            request.append_token(token_id)
            num_added += 1
            if token_logprobs is not None:
                request.logprobs.append(token_logprobs)
            self._check_stop(request, token_id)
            if request.status.is_finished:
                break
        request.num_spec_tokens, request.spec_token_ids = 0, []
        request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, request.num_computed_tokens)
        if not request.status.is_finished:
            self.kv_cache_manager.free_blocks_beyond(request, request.num_computed_tokens)
        return num_added

    def _schedule_drafts(self, scheduled: dict[str, ScheduledRequest], budget: int) -> int:
        """Add drafts to the decodes scheduled this step, in schedule order, while the budget and
        free blocks last. Returns the budget they took."""
        taken = 0
        for request_id, item in scheduled.items():
            request = item.request
            if not request.num_spec_tokens or item.num_new_tokens != 1 or not item.samples:
                continue
            num_drafts = min(self._num_drafts(request, budget - taken), self._num_draft_slots(request))
            if num_drafts and self.kv_cache_manager.allocate_slots(request, 1 + num_drafts) is not None:
                scheduled[request_id] = self._scheduled(request, 1 + num_drafts, num_drafts)
                taken += num_drafts
        return taken

    def _num_draft_slots(self, request: Request) -> int:
        """Drafts that fit after the request's next token in its own blocks and the free ones."""
        kv = self.kv_cache_manager
        num_blocks = len(kv.get_block_ids(request.request_id)) + kv.num_free_blocks
        return num_blocks * kv.block_size - request.num_computed_tokens - 1

    def _num_drafts(self, request: Request, budget: int) -> int:
        """How many of the request's wanted drafts to verify this step: no more than the budget
        left, and none past what max_tokens or the context would keep."""
        return max(
            0,
            min(
                request.num_spec_tokens,
                budget,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            ),
        )

    def kv_handoff(self, request: Request) -> KVHandoff:
        """Prefill role: the pinned blocks holding a finished-prefill request's prompt KV."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        num_blocks = cdiv(request.num_prompt_tokens, self.kv_cache_manager.block_size)
        return KVHandoff(
            block_ids=list(block_ids[:num_blocks]),
            num_tokens=request.num_prompt_tokens,
            draft_token_ids=list(request.spec_token_ids),
        )

    # ---------------------------------------------------------------- helpers

    def _chunk(self, num_tokens_left: int, budget: int, prefill_budget: int) -> int:
        """How many of a request's ``num_tokens_left`` tokens this step computes: a decode (one
        token) needs only the step budget; a prefill chunk also comes out of the prefill budget
        and stays within the per-request cap."""
        if num_tokens_left <= 1:
            return min(num_tokens_left, budget)
        cap = self.long_prefill_token_threshold or num_tokens_left
        return max(0, min(num_tokens_left, budget, prefill_budget, cap))

    def _scheduled(self, request: Request, num_new_tokens: int, num_draft_tokens: int = 0) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new_tokens,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            samples=request.num_computed_tokens + num_new_tokens - num_draft_tokens == request.num_tokens,
            num_draft_tokens=num_draft_tokens,
        )

    def _preempt(self, request: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free a running request's blocks and send it back to wait; returns budget it gave back."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = request.num_draft_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_admission_key)
        # Worth seeing in the logs: each one costs a recompute of the request's tokens.
        logger.info(
            "preempted %s for lack of KV blocks: %d tokens to recompute (%d preemptions since start)",
            request.request_id,
            request.num_tokens,
            self.num_preemptions,
        )
        taken_back = scheduled.pop(request.request_id, None)
        return taken_back.num_new_tokens if taken_back else 0

    def _check_stop(self, request: Request, token_id: int) -> None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token_id in params.stop_token_ids:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
                return
        if request.grammar is not None and request.grammar.is_finished:
            # The grammar is complete and allows nothing more (not even EOS sampled yet).
            request.status = RequestStatus.FINISHED_STOPPED
            return
        # An incomplete grammar cut short by the budget ends here too, as "length".
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH


def _num_prefill_tokens_left(request: Request) -> int:
    num_left = request.num_tokens - request.num_computed_tokens
    return num_left if num_left > 1 else 0
