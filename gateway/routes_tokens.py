"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's tokenizer, run on the work
pools under the request's client as every other tokenization (``gateway/tokenizer.py``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from gateway.app_state import Served
from gateway.gate import gate_pass_of
from gateway.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: dict[str, Any], raw: Request, served: Served) -> TokenizeResponse:
    # vLLM's two shapes: a prompt, or chat messages through the template.
    try:
        request = (TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest).model_validate(body)
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from error
    served.check_model(request.model)
    tokenizer, client = served.service.tokenizer, gate_pass_of(raw).client
    if isinstance(request, TokenizeChatRequest):
        tokens = await tokenizer.encode_chat(
            request.messages,
            client=client,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
        )
    else:
        tokens = await tokenizer.encode(request.prompt, client=client, add_special_tokens=request.add_special_tokens)
    return TokenizeResponse(count=len(tokens), max_model_len=served.service.max_model_len, tokens=tokens)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw: Request, served: Served) -> DetokenizeResponse:
    served.check_model(request.model)
    tokenizer = served.service.tokenizer
    tokenizer.check_token_ids(request.tokens, param="tokens")
    return DetokenizeResponse(prompt=await tokenizer.decode(request.tokens, client=gate_pass_of(raw).client))
