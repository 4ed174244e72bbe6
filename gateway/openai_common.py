"""Pieces both OpenAI endpoints use: sampling parameters from a request, the
server-sent-events framing, usage objects, and running a request so that a
client who leaves aborts it.

Every stream of ``GenerationService.stream`` opened here is closed on every path
(``aclosing``), so a request is aborted on its instances at once, never when the garbage
collector gets to it. Its pending slot is the gate's (``gateway/gate.py``), given back when
the response ends."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine.sampling_params import SamplingParams
from gateway.chunk_times import ChunkClock, ChunkTimedResponse
from gateway.errors import APIError, bad_request, internal_error
from gateway.gate import GatePass
from gateway.generation import Generated, GenerationJob, GenerationService, Usage
from gateway.log_safe import loggable_names
from gateway.protocol import ChatCompletionRequest, CompletionRequest, PromptTokensDetails, UsageInfo
from gateway.request_log import TIMING_HEADER
from gateway.structured_request import structured_request

logger = logging.getLogger(__name__)

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The engine's parameters for an OpenAI request. Raises APIError 400 for bad values."""
    if request.n != 1:
        raise bad_request("only n = 1 is supported; send one request per completion", param="n")
    if request.logit_bias:
        raise bad_request("logit_bias is not supported by this server", param="logit_bias")
    if request.ignored_fields:
        logger.info("ignoring fields this server does not know: %s", loggable_names(request.ignored_fields))
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p or 0.0,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
    except ValueError as error:
        # SamplingParams names the field first: "top_p must be in (0, 1], got 2.0".
        raise bad_request(str(error), param=str(error).split(" ", 1)[0]) from error


async def checked_sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    service: GenerationService,
    max_tokens: int | None,
    logprobs: int | None,
    gate_pass: GatePass,
) -> SamplingParams:
    """:func:`sampling_params`, plus the structured output the request asks for, compiled
    here first. Raises APIError 400 for bad values, an invalid schema, regex or grammar
    (429 when the grammar pool is full)."""
    params = sampling_params(request, max_tokens, logprobs)
    structured = structured_request(request)
    if structured is not None:
        with gate_pass.timing.stage("grammar compile"):
            await service.grammars.check(structured.spec, structured.param, gate_pass.client)
        params.structured = structured.spec
    return params


def usage_info(usages: list[Usage]) -> UsageInfo:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(u.cached_tokens for u in usages)),
    )


def sse(payload: BaseModel | dict[str, object]) -> str:
    body = payload.model_dump_json(exclude_unset=False) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def merged(service: GenerationService, jobs: list[GenerationJob]) -> AsyncGenerator[tuple[int, Generated], None]:
    """The deltas of several jobs (one per prompt) as they come, tagged with the job's index.
    Closing this stops every job that is still running."""
    if len(jobs) == 1:
        async with aclosing(service.stream(jobs[0])) as stream:
            async for delta in stream:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Generated] | tuple[int, BaseException] | tuple[int, None]] = asyncio.Queue()

    async def pump(index: int, job: GenerationJob) -> None:
        try:
            async with aclosing(service.stream(job)) as stream:
                async for delta in stream:
                    await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as error:  # handed to the consumer, which raises it (APIError included)
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_then_rest(stream: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """Start a stream now, so errors before its first item (429, 503, a refused prefill)
    still become an HTTP status rather than an error inside a 200 stream."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise

    async def rest() -> AsyncGenerator[T, None]:
        if first is None:
            return
        try:
            yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    return rest()


def timing_headers(jobs: list[GenerationJob]) -> dict[str, str] | None:
    """``x-splitserve-timing`` (gateway/request_log.py) for a one-prompt request whose first
    token is out; None otherwise (several prompts have a timing each: none is sent)."""
    value = jobs[0].timing_header() if len(jobs) == 1 else None
    return {TIMING_HEADER: value} if value is not None else None


def sse_response(
    chunks: AsyncIterator[str], headers: dict[str, str] | None = None, clock: ChunkClock | None = None
) -> StreamingResponse:
    """The stream as SSE, ending in ``data: [DONE]``; with ``clock`` (the client asked,
    gateway/chunk_times.py) each chunk's write time is recorded, and all of them are sent
    in a comment just before ``[DONE]``."""

    async def body() -> AsyncGenerator[str, None]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as error:
            # Headers are sent: report the failure in the stream, as OpenAI-compatible servers do.
            logger.warning("request failed mid-stream: %s", error)
            yield sse(error.to_response())
        except Exception:
            logger.exception("request failed mid-stream")
            yield sse(internal_error("while streaming").to_response())
        if clock is not None:
            yield clock.comment()
        yield SSE_DONE

    response_headers = {"Cache-Control": "no-cache", **(headers or {})}
    if clock is not None:
        return ChunkTimedResponse(body(), clock, headers=response_headers, media_type="text/event-stream")
    return StreamingResponse(body(), media_type="text/event-stream", headers=response_headers)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run a non-streaming request, cancelling it (which aborts it on the instances)
    if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()
