"""What the REST and gRPC fronts share: admit a request, check it against the
context length, dispatch it, turn its tokens into text (stop strings included),
and account for it in the metrics.

The fronts only translate: OpenAI JSON or protobuf in, ``Generated`` deltas out.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

from splitserve.v1 import generation_pb2

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from gateway.dispatch import Dispatcher, DispatchRequest
from gateway.errors import APIError, bad_request
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.tokenizer import ModelTokenizer
from serving.sampling_proto import sampling_params_to_proto

logger = logging.getLogger(__name__)


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

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    usage: Usage
    timer: RequestTimer
    deadline: float
    kv_transfer_s: float = 0.0
    dispatched_at: float = 0.0  # monotonic; when it left the gateway for an instance


class GenerationService:
    def __init__(
        self,
        pool: InstancePool,
        tokenizer: ModelTokenizer,
        metrics: GatewayMetrics,
        max_pending_requests: int,
        request_timeout_s: float,
        max_model_len: int | None = None,
    ) -> None:
        self.pool = pool
        self.dispatcher = Dispatcher(pool)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_pending_requests = max_pending_requests
        self.request_timeout_s = request_timeout_s
        self._max_model_len = max_model_len
        self.num_pending = 0

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
        max_tokens_param: str = "max_tokens",
    ) -> GenerationJob:
        """Check a request against the model. Raises APIError (400); admission happens in ``stream``."""
        timer = RequestTimer(self.metrics)
        if not prompt_token_ids:
            raise bad_request("the prompt is empty; send at least one token", param="prompt")
        self.tokenizer.check_token_ids(prompt_token_ids, param="prompt")
        max_model_len = self.max_model_len
        num_prompt = len(prompt_token_ids)
        if num_prompt >= max_model_len:
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens, but the prompt has {num_prompt} tokens "
                "(one more is needed for the output); shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )
        if params.max_tokens is None:
            params.max_tokens = max_model_len - num_prompt
        elif num_prompt + params.max_tokens > max_model_len:
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens, but {num_prompt + params.max_tokens} were "
                f"requested ({num_prompt} in the prompt, {params.max_tokens} for the completion); lower {max_tokens_param} "
                "or shorten the prompt",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        return GenerationJob(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=prompt_token_ids,
            params=params,
            priority=priority,
            usage=Usage(prompt_tokens=num_prompt),
            timer=timer,
            deadline=time.monotonic() + self.request_timeout_s,
        )

    async def stream(self, job: GenerationJob) -> AsyncIterator[Generated]:
        """Admit and run a job. Raises APIError (429 and 503 before anything streams, others
        whenever it fails); closing the stream early aborts the request everywhere."""
        if not self.pool.is_ready():
            job.timer.finished("error_503")
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "no healthy instances to serve the request; retry later", code="no_healthy_instance")
        if self.num_pending >= self.max_pending_requests:
            job.timer.finished("error_429")
            raise APIError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"the server is at its limit of {self.max_pending_requests} requests in flight; retry later",
                code="queue_full",
            )
        self.num_pending += 1
        # Text for every prompt: stop strings match on it even when the caller only wants token ids.
        detokenizer = IncrementalDetokenizer(self.tokenizer.tokenizer, job.prompt_token_ids, job.params)
        status = "abort"  # unless it finishes or fails
        self.metrics.prompt_tokens.inc(job.usage.prompt_tokens)
        job.dispatched_at = time.monotonic()
        self.metrics.queue.observe(job.dispatched_at - job.timer.arrival)
        dispatch = DispatchRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            sampling=sampling_params_to_proto(job.params),
            priority=job.priority,
            deadline=job.deadline,
        )
        events = self.dispatcher.generate(dispatch)
        try:
            async for event in events:
                if event.num_cached_tokens:
                    job.usage.cached_tokens = event.num_cached_tokens
                    self.metrics.cached_prompt_tokens.inc(event.num_cached_tokens)
                if event.kv_transfer is not None:
                    job.kv_transfer_s = event.kv_transfer.seconds
                    job.timer.kv_transfer(event.kv_transfer)
                update = detokenizer.update(event.token_ids)
                delta = Generated(update.text_delta, event.token_ids, event.logprobs, event.finish_reason, event.stop_token_id)
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
            raise
        finally:
            self.num_pending -= 1
            await events.aclose()
            job.timer.finished(status)
