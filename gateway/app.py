"""The OpenAI-compatible REST app, built from the routers of ``gateway/routes_*.py``: the
admission gate (API key, then a pending slot: ``gateway/gate.py``) and the body-size limit
before anything reads the body, a large body's check off the event loop before FastAPI
parses it (``gateway/body_check.py``), and errors in OpenAI's shape (a failure nobody expected
included: a 500 that says so). The routes find what they serve on ``app.state``
(``gateway/app_state.py``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import routes_openai, routes_probes, routes_tokens
from gateway.app_state import ServedState
from gateway.body_check import LargeBodyCheck
from gateway.errors import APIError, internal_error, validation_error
from gateway.gate import AdmissionGate
from gateway.generation import GenerationService
from gateway.limits import BodySizeLimit
from gateway.status import PlannerReader, status_page

logger = logging.getLogger(__name__)


def create_app(
    service: GenerationService,
    model_name: str,
    api_key: str | None,
    discovery_alive: Callable[[], bool] = lambda: True,
    planner_url: str | None = None,
) -> FastAPI:
    """``discovery_alive``: whether the loop that keeps the instance pool current still runs;
    without it the gateway routes on reports that only age, so ``/health`` answers 503."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None)
    app.state.served = ServedState(
        service=service,
        model_name=model_name,
        api_key=api_key,
        discovery_alive=discovery_alive,
        status_page=status_page(),  # read once: a missing file fails at start, not at the first visit
        planner=PlannerReader(planner_url) if planner_url else None,
    )
    # Added last, so outermost: the key and a slot before the body is read (gateway/gate.py),
    # then its size, then a large body's values counted off the event loop (gateway/body_check.py).
    app.add_middleware(LargeBodyCheck, check=service.body_check)
    app.add_middleware(BodySizeLimit, max_bytes=service.limits.max_body_bytes)
    app.add_middleware(
        AdmissionGate,
        api_key=api_key,
        open_paths=routes_probes.OPEN_PATHS,
        slots=service.slots,
        refused=service.metrics.requests,
    )
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    # In this order, so that the OpenAPI schema lists the paths as it always has.
    for router in (routes_probes.router, routes_openai.router, routes_tokens.router):
        app.include_router(router)
    return app


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return _error_response(error)


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    # Starlette sends this, then re-raises the error for the server to log with its traceback.
    return _error_response(internal_error(f"serving {request.url.path}"))


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return _error_response(validation_error(error.errors()))


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return _error_response(APIError(HTTPStatus(error.status_code), str(error.detail)))


def _error_response(error: APIError) -> JSONResponse:
    if error.status >= 500:
        logger.warning("answering %d: %s", error.status, error.message)
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if error.retry_after_s is not None else None
    return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=headers)
