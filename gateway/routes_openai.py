"""OpenAI's routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (their
bodies in ``gateway/openai_completions.py`` and ``gateway/openai_chat.py``), and ``/``,
which points a visitor at them."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from gateway.app_state import Served
from gateway.openai_chat import create_chat_completion
from gateway.openai_completions import create_completion
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def models(served: Served) -> ModelList:
    # root: the served name, not the folder the gateway loaded it from (a path says how the host is laid out).
    card = ModelCard(id=served.model_name, root=served.model_name, max_model_len=served.service.max_model_len)
    return ModelList(data=[card])


@router.post("/v1/completions", response_model=None)
async def completions(request: CompletionRequest, raw: Request, served: Served) -> JSONResponse | StreamingResponse:
    served.check_model(request.model)
    return await create_completion(request, raw, served.service, served.model_name)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    request: ChatCompletionRequest, raw: Request, served: Served
) -> JSONResponse | StreamingResponse:
    served.check_model(request.model)
    return await create_chat_completion(request, raw, served.service, served.model_name)


@router.get("/", include_in_schema=False)
async def root(served: Served) -> PlainTextResponse:
    return PlainTextResponse(f"splitserve: OpenAI-compatible API for {served.model_name} at /v1\n")
