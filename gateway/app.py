"""The OpenAI-compatible REST app: routes, the admission gate (API key, then a pending
slot: ``gateway/gate.py``) and the body-size limit before anything reads the body, and
errors in OpenAI's shape (a failure nobody expected included: a 500 that says so)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import APIError, internal_error, unknown_model
from gateway.gate import AdmissionGate, admission_of
from gateway.generation import GenerationService
from gateway.instances import ROLES
from gateway.limits import BodySizeLimit
from gateway.openai_chat import create_chat_completion
from gateway.openai_completions import create_completion
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from gateway.status import (
    STATUS_AUTH_CHALLENGE,
    STATUS_PATHS,
    StatusResponse,
    status_authorized,
    status_page,
    status_snapshot,
)

logger = logging.getLogger(__name__)

# Probes and scrapes stay open when an API key is set (as in vLLM: the key guards the API); they
# show no prompt and no secret. The status page checks the key itself (it takes a browser's
# Basic authentication too, gateway/status.py): it shows internal addresses and engine errors.
_OPEN_PATHS = {"/health", "/ready", "/metrics"} | STATUS_PATHS


def create_app(
    service: GenerationService,
    model_name: str,
    api_key: str | None,
    discovery_alive: Callable[[], bool] = lambda: True,
    model_root: str | None = None,
) -> FastAPI:
    """``discovery_alive``: whether the loop that keeps the instance pool current still runs;
    without it the gateway routes on reports that only age, so ``/health`` answers 503.
    ``model_root``: the folder the model (its tokenizer) was loaded from, shown as ``root`` in
    ``/v1/models`` as vLLM does, so that a client on the same host can tokenize alike."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None)
    page = status_page()  # read once: a missing file fails at start, not at the first visit

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise unknown_model(model, model_name)

    # Added last, so outermost: the key and a slot before the body is read (gateway/gate.py).
    app.add_middleware(BodySizeLimit, max_bytes=service.limits.max_body_bytes)
    app.add_middleware(
        AdmissionGate,
        api_key=api_key,
        open_paths=_OPEN_PATHS,
        slots=service.slots,
        refused=service.metrics.requests,
    )

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        # Starlette sends this, then re-raises the error for the server to log with its traceback.
        return _error_response(internal_error(f"serving {request.url.path}"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        location = _field_path(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            message, location = f"the request body is not valid JSON: {first.get('msg', '')}", []
        else:
            message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid value')}"
        return _error_response(APIError(HTTPStatus.BAD_REQUEST, message, ".".join(location) or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(HTTPStatus(error.status_code), str(error.detail)))

    @app.get("/health")
    async def health() -> Response:
        if not discovery_alive():
            return PlainTextResponse("instance discovery has stopped: restart the gateway\n", status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        pool = service.pool
        body = {
            "ready": discovery_alive() and pool.is_ready(),
            "instances": {role: len(pool.healthy(role)) for role in ROLES},
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def status_refused(request: Request) -> JSONResponse | None:
        """None when the status page may be shown: no API key is set, or the request carries it."""
        if api_key is None or status_authorized(request.headers.get("authorization", ""), api_key):
            return None
        error = APIError(
            HTTPStatus.UNAUTHORIZED,
            "the status page needs the API key: 'Authorization: Bearer <key>', or the key as the password of HTTP "
            "Basic authentication (curl -u :KEY)",
            code="invalid_api_key",
        )
        return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=STATUS_AUTH_CHALLENGE)

    @app.get("/status", include_in_schema=False)
    async def status(request: Request) -> Response:
        return status_refused(request) or HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/status.json", response_model=StatusResponse)
    async def status_json(request: Request) -> Response | StatusResponse:
        refused = status_refused(request)
        if refused is not None:
            return refused
        ready = discovery_alive() and service.pool.is_ready()
        return status_snapshot(service.pool, service.metrics.recent, model_name, ready)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[ModelCard(id=model_name, root=model_root or model_name, max_model_len=service.max_model_len)]
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        check_model(request.model)
        return await create_completion(request, raw, service, model_name)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        check_model(request.model)
        return await create_chat_completion(request, raw, service, model_name)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any], raw: Request) -> TokenizeResponse:
        # vLLM's two shapes: a prompt, or chat messages through the template.
        try:
            request = (TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest).model_validate(body)
        except ValidationError as error:
            raise RequestValidationError(error.errors()) from error
        check_model(request.model)
        tokenizer, client = service.tokenizer, admission_of(raw).client
        if isinstance(request, TokenizeChatRequest):
            tokens = await tokenizer.encode_chat(
                request.messages,
                client=client,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request.chat_template_kwargs,
            )
        else:
            tokens = await tokenizer.encode(
                request.prompt, client=client, add_special_tokens=request.add_special_tokens
            )
        return TokenizeResponse(count=len(tokens), max_model_len=service.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        check_model(request.model)
        service.tokenizer.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(
            prompt=await service.tokenizer.decode(request.tokens, client=admission_of(raw).client)
        )

    @app.get("/", include_in_schema=False)
    async def root() -> PlainTextResponse:
        return PlainTextResponse(f"splitserve: OpenAI-compatible API for {model_name} at /v1\n")

    return app


def _field_path(location: tuple[int | str, ...]) -> list[str]:
    """A pydantic error location as the request's field path: without "body", and without
    the union members pydantic tries ("str", "list[str]", "function-after[...]")."""
    return [str(part) for part in location if part != "body" and not (isinstance(part, str) and _is_union_tag(part))]


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "none"}


def _error_response(error: APIError) -> JSONResponse:
    if error.status >= 500:
        logger.warning("answering %d: %s", error.status, error.message)
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if error.retry_after_s is not None else None
    return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=headers)
