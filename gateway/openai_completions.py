"""``POST /v1/completions``: prompts (text or token ids, one or several) to
``text_completion`` objects, whole or streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.chunk_times import chunk_clock
from gateway.errors import bad_request
from gateway.gate import GatePass, gate_pass_of
from gateway.generation import Generated, GenerationJob, GenerationService
from gateway.openai_common import (
    cancel_on_disconnect,
    checked_sampling_params,
    first_then_rest,
    merged,
    sse,
    sse_response,
    timing_headers,
    usage_info,
)
from gateway.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from gateway.request_trace import caller_trace_headers
from gateway.stream_chunks import StreamChunks
from gateway.tokenizer import ModelTokenizer


class CompletionLogprobsBuilder:
    """Accumulates the legacy logprobs object of one choice."""

    def __init__(self, tokenizer: ModelTokenizer, text_offset: int) -> None:
        self.tokenizer = tokenizer
        self.text_offset = text_offset

    def build(self, delta: Generated) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for entry in delta.logprobs:
            token = self.tokenizer.token_text(entry.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append({self.tokenizer.token_text(t.token_id): t.logprob for t in entry.top})
            result.text_offset.append(self.text_offset)
            self.text_offset += len(token)
        return result


async def _prompts(
    request: CompletionRequest, service: GenerationService, gate_pass: GatePass
) -> list[tuple[list[int], str | None]]:
    """Each prompt as token ids, with its text when given as text. Each prompt past the first
    takes a pending slot of its own, before any is tokenized."""
    prompt, client = request.prompt, gate_pass.client
    if isinstance(prompt, str):
        with gate_pass.timing.stage("tokenize"):
            return [(await service.tokenizer.encode(prompt, client=client), prompt)]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    # The protocol model admits only the four shapes: ints, texts or token lists, never a mix.
    token_ids = [p for p in prompt if isinstance(p, int)]
    if len(token_ids) == len(prompt):
        return [(token_ids, None)]
    service.limits.check_num_prompts(len(prompt))
    gate_pass.take_more(len(prompt) - 1)
    texts = [p for p in prompt if isinstance(p, str)]
    if len(texts) == len(prompt):
        with gate_pass.timing.stage("tokenize"):
            return [
                (await service.tokenizer.encode(text, client=client, param=f"prompt.{i}"), text)
                for i, text in enumerate(texts)
            ]
    return [(list(p), None) for p in prompt if isinstance(p, list)]


async def create_completion(
    request: CompletionRequest, raw: Request, service: GenerationService, model_name: str
) -> JSONResponse | StreamingResponse:
    if request.best_of not in (None, 1):
        raise bad_request("only best_of = 1 is supported", param="best_of")
    if request.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute", param="echo")
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    gate_pass = gate_pass_of(raw)
    prompts = await _prompts(request, service, gate_pass)
    jobs = []
    # Validated (and extras logged) once for every prompt.
    params = await checked_sampling_params(request, service, request.max_tokens, request.logprobs, gate_pass)
    for index, (token_ids, _) in enumerate(prompts):
        request_id = completion_id if len(prompts) == 1 else f"{completion_id}-{index}"
        # Each job gets its own copy: prepare fills in max_tokens from its prompt's length.
        jobs.append(
            service.prepare(
                token_ids,
                replace(params),
                request_id=request_id,
                priority=request.priority,
                cache_salt=request.cache_salt,
                edge=gate_pass.timing,
                caller_trace=caller_trace_headers(raw.headers),
                operation="text_completion",
            )
        )
    echoes = [
        (text if text is not None else await service.tokenizer.decode(ids, client=gate_pass.client))
        if request.echo
        else ""
        for ids, text in prompts
    ]
    if request.stream:
        deltas = await first_then_rest(merged(service, jobs))
        return sse_response(
            _stream(request, completion_id, model_name, service, jobs, echoes, deltas),
            timing_headers(jobs),
            chunk_clock(raw.headers),
        )
    response = await cancel_on_disconnect(raw, _collect(request, completion_id, model_name, service, jobs, echoes))
    return JSONResponse(response.model_dump(), headers=timing_headers(jobs))


async def _collect(
    request: CompletionRequest,
    completion_id: str,
    model_name: str,
    service: GenerationService,
    jobs: list[GenerationJob],
    echoes: list[str],
) -> CompletionResponse:
    choices = [CompletionChoice(index=i, text=echoes[i]) for i in range(len(jobs))]
    builders = [CompletionLogprobsBuilder(service.tokenizer, len(echoes[i])) for i in range(len(jobs))]
    async for index, delta in merged(service, jobs):
        choice = choices[index]
        choice.text += delta.text
        if request.logprobs is not None:
            built = builders[index].build(delta)
            if choice.logprobs is None:
                choice.logprobs = CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(choice.logprobs, name).extend(getattr(built, name))
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
    return CompletionResponse(
        id=completion_id, model=model_name, choices=choices, usage=usage_info([job.usage for job in jobs])
    )


async def _stream(
    request: CompletionRequest,
    completion_id: str,
    model_name: str,
    service: GenerationService,
    jobs: list[GenerationJob],
    echoes: list[str],
    deltas: AsyncIterator[tuple[int, Generated]],
) -> AsyncGenerator[str, None]:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    builders = [CompletionLogprobsBuilder(service.tokenizer, len(echoes[i])) for i in range(len(jobs))]
    echoed = [False] * len(jobs)
    chunks = StreamChunks(completion_id, model_name, "text_completion")
    async for index, delta in deltas:
        text = delta.text
        if not echoed[index]:
            text, echoed[index] = echoes[index] + text, True
        if request.logprobs is None:
            yield chunks.text(index, text, delta.finish_reason, delta.stop_reason)
            continue
        chunk = CompletionResponse(
            id=completion_id,
            model=model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=builders[index].build(delta),
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
            ],
        )
        yield sse(chunk)
    if include_usage:
        yield sse(
            CompletionResponse(
                id=completion_id, model=model_name, choices=[], usage=usage_info([job.usage for job in jobs])
            )
        )
