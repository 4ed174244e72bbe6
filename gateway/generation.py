"""What the REST and gRPC fronts share: admit a request, check it against the
context length, dispatch it, turn its tokens into text (stop strings included),
and account for it in the metrics.

The fronts only translate: OpenAI JSON or protobuf in, ``Generated`` deltas out.

A request's life here, in call order:

0. The front admitted the request first (``gateway/gate.py``): the API key, then a
   pending slot (``slots``), held until its response has ended, before any costly work.
1. ``prepare`` (the front's task): every check that needs the model or the flags
   (empty prompt, vocabulary, context length, stop limits, priority) and the
   conversion into the protobuf the instances get. Any failure is a 400.
2. ``stream``: refuse with 503 when no instance is ready; from there on everything
   sits in one ``try`` whose ``finally`` accounts for the request, whatever ends it
   (its end, a stop string, an error of any kind, the client leaving and the task
   being cancelled).
3. The dispatcher's event stream is closed in the same ``finally``, which aborts
   the request on its instances if it has not finished.

Instances know a request by the gateway's own id (``GenerationJob.request_id``),
never by an id a client chose: two clients may pick the same one.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, replace
from http import HTTPStatus

from prometheus_client import Counter, Gauge

from cluster.sampling_proto import sampling_params_to_proto
from cluster.tracing import Tracer
from engine.context_length import ContextLengthExceeded, resolve_max_tokens
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from gateway.body_check import BodyCheck
from gateway.dispatch import Dispatcher
from gateway.dispatch_request import DispatchRequest, TokenEvent
from gateway.errors import APIError, bad_request
from gateway.flags import DEFAULT_MAX_MIGRATIONS, RequestLogFormat
from gateway.gate import PendingSlots
from gateway.instances import InstancePool
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.request_log import (
    FinishedRequest,
    GenAIOperation,
    finish_attributes,
    log_finished,
    request_attributes,
    timing_header,
)
from gateway.request_trace import EdgeTiming, RequestTrace
from gateway.structured_request import GrammarValidator
from gateway.tokenizer import ModelTokenizer
from gateway.work_pool import WorkPool
from splitserve.v1 import generation_pb2

logger = logging.getLogger(__name__)

# A gateway with nothing to route to answers every request 503: why goes to the log at most this often.
UNREADY_LOG_INTERVAL_S = 5.0


@dataclass(slots=True)
class Generated:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    logprobs: list[generation_pb2.TokenLogprob]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class GenerationJob:
    """One admitted request; iterate ``stream()`` once."""

    request_id: str  # the gateway's own; instances know the request by it
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: generation_pb2.SamplingParams  # params as the instances get them
    priority: int
    cache_salt: str | None
    usage: Usage
    timer: RequestTimer
    deadline: float
    kv_transfer_s: float = 0.0
    trace: RequestTrace | None = None  # its spans here, when tracing is on
    ended_at: float | None = None  # monotonic

    def timing_header(self) -> str | None:
        """``x-splitserve-timing`` (gateway/request_log.py) once its first token is out; None before."""
        timer = self.timer
        if timer.first_token_at is None or timer.phases is None:
            return None
        e2e_s = self.ended_at - timer.arrival if self.ended_at is not None else None
        return timing_header(timer.first_token_at - timer.arrival, timer.phases, e2e_s)

    def finished_record(self, outcome: str) -> FinishedRequest:
        timer = self.timer
        ended_at = self.ended_at if self.ended_at is not None else time.monotonic()
        return FinishedRequest(
            request_id=self.request_id,
            trace_id=self.trace.trace_id if self.trace is not None else None,
            outcome=outcome,
            prompt_tokens=self.usage.prompt_tokens,
            cached_tokens=self.usage.cached_tokens,
            completion_tokens=self.usage.completion_tokens,
            ttft_s=timer.first_token_at - timer.arrival if timer.first_token_at is not None else None,
            e2e_s=ended_at - timer.arrival,
            kv_transfer_s=self.kv_transfer_s,
            phases=timer.phases,
        )


class GenerationService:
    def __init__(
        self,
        pool: InstancePool,
        tokenizer: ModelTokenizer,
        metrics: GatewayMetrics,
        max_pending_requests: int,
        request_timeout_s: float,
        max_model_len: int | None = None,
        enable_priority: bool = False,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        disagg_min_prompt_tokens: int = 0,
        model_name: str = "",
        tracer: Tracer | None = None,
        request_log: RequestLogFormat = "off",
        max_pending_per_client: int | None = None,
    ) -> None:
        """``model_name``: the served name (traces name requests by it); ``tracer``: None when
        tracing is off; ``request_log``: a line per finished request (gateway/request_log.py);
        ``max_pending_per_client``: one client's share of the pending slots (None: the default)."""
        self.pool = pool
        self.model_name = model_name
        self.tracer = tracer
        self.request_log = request_log
        self.dispatcher = Dispatcher(pool, metrics, max_migrations, disagg_min_prompt_tokens)
        self.tokenizer = tokenizer
        # Fronts check a structured output with it before prepare.
        self.grammars = GrammarValidator(tokenizer, tokenizer.limits.grammar_compile_timeout_s)
        self.metrics = metrics
        # Taken at the gate (gateway/gate.py).
        self.slots = PendingSlots(max_pending_requests, max_pending_per_client)
        # Large REST bodies checked off the event loop before FastAPI parses them.
        self.body_check = BodyCheck(tokenizer.limits.max_json_values)
        self.request_timeout_s = request_timeout_s
        self._max_model_len = max_model_len
        self.enable_priority = enable_priority
        self._unready_said_at = -UNREADY_LOG_INTERVAL_S  # monotonic: when a 503 last logged why
        # Here rather than in GatewayMetrics: the counts live in these objects.
        Gauge(
            "splitserve_num_pending_requests",
            "Requests holding a pending slot (--max-pending-requests)",
            registry=metrics.registry,
        ).set_function(lambda: self.slots.num_pending)
        running = Gauge(
            "splitserve_work_pool_running",
            "Tasks running on a work pool (tokenizer: templates, tokenizing; grammar: compiles; body_check: "
            "large bodies)",
            ["pool"],
            registry=metrics.registry,
        )
        waiting = Gauge(
            "splitserve_work_pool_waiting", "Tasks queued on a work pool", ["pool"], registry=metrics.registry
        )
        refused = Counter(
            "splitserve_work_pool_refused",
            "Tasks a work pool refused with 429 (its queue, or the client's share of it, was full)",
            ["pool"],
            registry=metrics.registry,
        )
        for work_pool in (tokenizer.pool, self.grammars.pool, self.body_check.pool):
            _watch(work_pool, running, waiting, refused)

    @property
    def num_pending(self) -> int:
        return self.slots.num_pending

    def close(self) -> None:
        """Stop the grammar pool's threads and the body check's processes (the tokenizer's
        threads are its owner's to close)."""
        self.grammars.close()
        self.body_check.close()

    @property
    def limits(self) -> RequestLimits:
        return self.tokenizer.limits

    @property
    def max_model_len(self) -> int:
        """The context a request must fit: the flag, else what instances report, else the model config."""
        return self._max_model_len or self.pool.max_model_len() or self.tokenizer.config_max_model_len or 2048

    def prepare(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens_param: str = "max_tokens",
        edge: EdgeTiming | None = None,
        caller_trace: Mapping[str, str] | None = None,
        operation: GenAIOperation = "text_completion",
    ) -> GenerationJob:
        """Check a request against the model and the flags, and convert it for the instances.
        Raises APIError (400); admission happens in ``stream``.

        ``request_id`` is an id the gateway chose (a completion's id); by default a new one.
        A client's own id must never be passed: instances key requests by it. ``edge``: the
        request's arrival at the gate and what the edge did since (default: it arrives now);
        ``caller_trace``: the client's W3C trace headers, which its trace continues."""
        edge = edge or EdgeTiming()
        timer = RequestTimer(self.metrics, edge.arrived_at)
        if priority and not self.enable_priority:
            raise bad_request(
                f"priority {priority} was requested, but priority scheduling is off on this gateway "
                "(--enable-priority); send 0 or leave it out",
                param="priority",
            )
        self.limits.check_stop(params.stop, params.stop_token_ids)
        if not prompt_token_ids:
            raise bad_request("the prompt is empty; send at least one token", param="prompt")
        self.tokenizer.check_token_ids(prompt_token_ids, param="prompt")
        num_prompt = len(prompt_token_ids)
        try:
            params.max_tokens = resolve_max_tokens(num_prompt, params.max_tokens, self.max_model_len, max_tokens_param)
        except ContextLengthExceeded as error:
            raise bad_request(str(error), param=error.param, code="context_length_exceeded") from None
        try:
            sampling = sampling_params_to_proto(params)
        except (ValueError, TypeError) as error:
            # Both fronts bound every field to its wire type, so this is ours to fix.
            raise RuntimeError(f"sampling parameters {params} do not fit the protobuf (bug): {error}") from error
        request_id = request_id or uuid.uuid4().hex
        trace = None
        if self.tracer is not None:
            trace = RequestTrace(
                self.tracer,
                f"{operation} {self.model_name}",
                caller_trace,
                edge,
                request_attributes(operation, self.model_name, request_id, num_prompt, params),
            )
        return GenerationJob(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            sampling=sampling,
            priority=priority,
            cache_salt=cache_salt,
            usage=Usage(prompt_tokens=num_prompt),
            timer=timer,
            deadline=time.monotonic() + self.request_timeout_s,
            trace=trace,
        )

    async def stream(self, job: GenerationJob) -> AsyncGenerator[Generated, None]:
        """Run a job of an admitted request. Raises APIError (503 before anything streams,
        others whenever it fails); closing the stream early aborts the request everywhere."""
        if not self.pool.is_ready():
            now = time.monotonic()
            if now - self._unready_said_at >= UNREADY_LOG_INTERVAL_S:
                self._unready_said_at = now
                logger.warning("answering 503, no instance to serve requests: %s", self.pool.unready_reason())
            self._finished(job, "error_503")
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "no healthy instances to serve the request; retry later",
                code="no_healthy_instance",
            )
        status = "abort"  # unless it finishes or fails
        events: AsyncGenerator[TokenEvent, None] | None = None
        try:
            # Text for every prompt: stop strings match on it even when the caller only wants token ids.
            detokenizer = IncrementalDetokenizer(self.tokenizer.tokenizer, job.prompt_token_ids, job.params)
            self.metrics.prompt_tokens.inc(job.usage.prompt_tokens)
            job.timer.dispatched()
            dispatch = DispatchRequest(
                request_id=job.request_id,
                prompt_token_ids=job.prompt_token_ids,
                sampling=job.sampling,
                priority=job.priority,
                deadline=job.deadline,
                cache_salt=job.cache_salt or "",
                trace=job.trace,
            )
            events = self.dispatcher.generate(dispatch)
            async for event in events:
                if event.num_cached_tokens:
                    job.usage.cached_tokens = event.num_cached_tokens
                    self.metrics.cached_prompt_tokens.inc(event.num_cached_tokens)
                if event.kv_transfer is not None:
                    job.kv_transfer_s = event.kv_transfer.seconds
                    job.timer.kv_transfer(event.kv_transfer)
                if event.call_sent_at is not None and event.answered_at is not None:
                    job.timer.call_answered(event.call_sent_at, event.answered_at)
                if event.phases is not None:
                    job.timer.instance_phases(event.phases)
                update = detokenizer.update(event.token_ids)
                delta = Generated(
                    update.text_delta, event.token_ids, event.logprobs, event.finish_reason, event.stop_token_id
                )
                if update.stop_string is not None:
                    delta.finish_reason, delta.stop_reason = "stop", update.stop_string
                elif event.finish_reason is not None:
                    delta.text += detokenizer.flush()
                job.usage.completion_tokens += len(event.token_ids)
                job.timer.tokens_sent(len(event.token_ids))
                if delta.finish_reason is not None:
                    status = delta.finish_reason
                yield delta
                if delta.finish_reason is not None:
                    return  # a stop string: leaving the loop aborts the request on its instance
        except APIError as error:
            status = f"error_{error.status.value}"
            if error.detail is None:
                raise
            # What failed inside the cluster stays here; the client gets the id to ask about.
            logger.warning("request %s failed (%d): %s", job.request_id, error.status, error.detail)
            raise replace(
                error, message=f"{error.message} (request {job.request_id}; the gateway's log has the details)"
            ) from None
        except Exception:
            status = "error_500"
            raise
        finally:
            try:
                if events is not None:
                    await events.aclose()
            finally:
                self._finished(job, status)

    def _finished(self, job: GenerationJob, status: str) -> None:
        """Account for a request that ended: metrics, its log line, its trace's root span."""
        job.timer.finished(status)
        job.ended_at = time.monotonic()
        if self.request_log == "off" and job.trace is None:
            return
        record = job.finished_record(status)
        log_finished(self.request_log, record)
        if job.trace is not None:
            job.trace.finish(
                job.ended_at, status, finish_attributes(record), job.timer.first_token_at, job.timer.phases
            )


def _watch(work_pool: WorkPool, running: Gauge, waiting: Gauge, refused: Counter) -> None:
    running.labels(pool=work_pool.name).set_function(lambda: work_pool.num_running)
    waiting.labels(pool=work_pool.name).set_function(lambda: work_pool.num_waiting)
    work_pool.on_refused = refused.labels(pool=work_pool.name).inc
