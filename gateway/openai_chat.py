"""``POST /v1/chat/completions``: a conversation through the model's chat template
to ``chat.completion`` objects, or ``chat.completion.chunk`` streams."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.chunk_times import chunk_clock
from gateway.errors import bad_request
from gateway.gate import gate_pass_of
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
from gateway.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from gateway.request_trace import caller_trace_headers
from gateway.stream_chunks import StreamChunks
from gateway.tokenizer import ModelTokenizer


def _logprobs(tokenizer: ModelTokenizer, delta: Generated) -> ChatLogprobs:
    content = []
    for entry in delta.logprobs:
        token = tokenizer.token_text(entry.token_id)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=entry.logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(text := tokenizer.token_text(t.token_id)), logprob=t.logprob, bytes=list(text.encode())
                    )
                    for t in entry.top
                ],
            )
        )
    return ChatLogprobs(content=content)


def _num_logprobs(request: ChatCompletionRequest) -> int | None:
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if not request.logprobs:
        return None
    return request.top_logprobs or 0  # its range is the request model's


async def create_chat_completion(
    request: ChatCompletionRequest, raw: Request, service: GenerationService, model_name: str
) -> JSONResponse | StreamingResponse:
    # OpenAI's default is "as long as the context allows" (max_tokens None).
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    gate_pass = gate_pass_of(raw)
    params = await checked_sampling_params(request, service, max_tokens, _num_logprobs(request), gate_pass)
    with gate_pass.timing.stage("chat template"):  # rendered and tokenized
        token_ids = await service.tokenizer.encode_chat(
            request.messages,
            client=gate_pass.client,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
        )
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    job = service.prepare(
        token_ids,
        params,
        request_id=completion_id,
        priority=request.priority,
        cache_salt=request.cache_salt,
        max_tokens_param=max_tokens_param,
        edge=gate_pass.timing,
        caller_trace=caller_trace_headers(raw.headers),
        operation="chat",
    )
    if request.stream:
        deltas = await first_then_rest(merged(service, [job]))
        return sse_response(
            _stream(request, completion_id, model_name, service, job, deltas),
            timing_headers([job]),
            chunk_clock(raw.headers),
        )
    response = await cancel_on_disconnect(raw, _collect(request, completion_id, model_name, service, job))
    return JSONResponse(response.model_dump(), headers=timing_headers([job]))


async def _collect(
    request: ChatCompletionRequest, completion_id: str, model_name: str, service: GenerationService, job: GenerationJob
) -> ChatCompletionResponse:
    choice = ChatChoice(
        index=0,
        message=ChatResponseMessage(content=""),
        logprobs=ChatLogprobs(content=[]) if request.logprobs else None,
    )
    async for _, delta in merged(service, [job]):
        choice.message.content = (choice.message.content or "") + delta.text
        if choice.logprobs is not None and choice.logprobs.content is not None:
            choice.logprobs.content.extend(_logprobs(service.tokenizer, delta).content or [])
        if delta.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
    return ChatCompletionResponse(id=completion_id, model=model_name, choices=[choice], usage=usage_info([job.usage]))


async def _stream(
    request: ChatCompletionRequest,
    completion_id: str,
    model_name: str,
    service: GenerationService,
    job: GenerationJob,
    deltas: AsyncIterator[tuple[int, Generated]],
) -> AsyncGenerator[str, None]:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    chunks = StreamChunks(completion_id, model_name, "chat.completion.chunk")

    # As OpenAI does: the role first, then content deltas, then the finish reason.
    yield chunks.delta("", role="assistant")
    async for _, delta in deltas:
        if not request.logprobs:
            yield chunks.delta(delta.text, delta.finish_reason, delta.stop_reason)
            continue
        choice = ChatChunkChoice(
            index=0,
            delta=DeltaMessage(content=delta.text),
            logprobs=_logprobs(service.tokenizer, delta),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        yield sse(ChatCompletionChunk(id=completion_id, model=model_name, choices=[choice]))
    if include_usage:
        yield sse(ChatCompletionChunk(id=completion_id, model=model_name, choices=[], usage=usage_info([job.usage])))
