"""The operator's routes: ``/health``, ``/ready``, ``/metrics`` (open to all even with an API
key, as in vLLM: they show no prompt and no secret) and the status page (``/status``,
``/status.json``), which checks the key itself (``gateway/status.py``): it shows internal
addresses and engine errors."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.app_state import Served, ServedState
from gateway.errors import APIError
from gateway.instances import ROLES
from gateway.status import STATUS_AUTH_CHALLENGE, STATUS_PATHS, StatusResponse, status_authorized, status_snapshot

# The paths the gate lets through without the API key (gateway/gate.py).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"}) | STATUS_PATHS

router = APIRouter()


@router.get("/health")
async def health(served: Served) -> Response:
    if not served.discovery_alive():
        return PlainTextResponse("instance discovery has stopped: restart the gateway\n", status_code=503)
    return Response(status_code=200)


@router.get("/ready")
async def ready(served: Served) -> JSONResponse:
    pool = served.service.pool
    body = {
        "ready": served.is_ready(),
        "instances": {role: len(pool.healthy(role)) for role in ROLES},
    }
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


@router.get("/metrics")
async def metrics(served: Served) -> Response:
    return Response(served.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/status", include_in_schema=False)
async def status(request: Request, served: Served) -> Response:
    return _status_refused(request, served) or HTMLResponse(served.status_page, headers={"Cache-Control": "no-cache"})


@router.get("/status.json", response_model=StatusResponse)
async def status_json(request: Request, served: Served) -> Response | StatusResponse:
    refused = _status_refused(request, served)
    if refused is not None:
        return refused
    service = served.service
    planner = await served.planner.read() if served.planner is not None else None
    return status_snapshot(service.pool, service.metrics.recent, served.model_name, served.is_ready(), planner)


def _status_refused(request: Request, served: ServedState) -> JSONResponse | None:
    """None when the status page may be shown: no API key is set, or the request carries it."""
    if served.api_key is None or status_authorized(request.headers.get("authorization", ""), served.api_key):
        return None
    error = APIError(
        HTTPStatus.UNAUTHORIZED,
        "the status page needs the API key: 'Authorization: Bearer <key>', or the key as the password of HTTP "
        "Basic authentication (curl -u :KEY)",
        code="invalid_api_key",
    )
    return JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=STATUS_AUTH_CHALLENGE)
