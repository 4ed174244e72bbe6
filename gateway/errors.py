"""Errors the gateway answers with, in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, and their HTTP and gRPC statuses.

Anything the client did wrong is a 4xx with a message that says how to fix it;
a 500 means a bug in splitserve. What failed inside the cluster (which instance, at which
address, with which error) is never sent to the client: such an error carries it as
``detail``, which ``GenerationService.stream`` logs under the request's id, and the client
gets a generic message naming that id (:func:`instance_failure`).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus

import grpc

from gateway.protocol import ErrorInfo, ErrorResponse

# OpenAI's error "type" for each status the gateway uses.
_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable_error",
    HTTPStatus.GATEWAY_TIMEOUT: "timeout_error",
}

_GRPC_CODES = {
    HTTPStatus.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    HTTPStatus.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    HTTPStatus.TOO_MANY_REQUESTS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    HTTPStatus.SERVICE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    HTTPStatus.GATEWAY_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass
class APIError(Exception):
    """An error to answer a request with. Raised anywhere below the HTTP/gRPC handlers."""

    status: HTTPStatus
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None  # 429 / 503: sent as ``Retry-After`` (whole seconds)
    detail: str | None = None  # for the gateway's log only, never sent: what failed inside the cluster

    def __str__(self) -> str:
        return self.message

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.INTERNAL)

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param, code)


def validation_error(errors: Sequence[Mapping[str, object]]) -> APIError:
    """The 400 for pydantic's validation errors of a request body (the first one named): the
    field's path as the client wrote it, and pydantic's message."""
    first = errors[0] if errors else {}
    location = _field_path(first.get("loc", ()))  # type: ignore[arg-type]
    if first.get("type") == "json_invalid":
        message, location = f"the request body is not valid JSON: {first.get('msg', '')}", []
    else:
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid value')}"
    return APIError(HTTPStatus.BAD_REQUEST, message, ".".join(location) or None)


def _field_path(location: tuple[int | str, ...]) -> list[str]:
    """A pydantic error location as the request's field path: without "body", and without
    the union members pydantic tries ("str", "list[str]", "function-after[...]")."""
    return [str(part) for part in location if part != "body" and not (isinstance(part, str) and _is_union_tag(part))]


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "none"}


def internal_error(where: str) -> APIError:
    """What a client sees of an unexpected failure; the traceback goes to the log."""
    return APIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"internal error {where}; this is a bug in splitserve (the gateway's log has the details)",
        code="internal_error",
    )


def unknown_model(model: str, served: str) -> APIError:
    return APIError(
        HTTPStatus.NOT_FOUND,
        f"the model {model!r} does not exist; this server serves {served!r}",
        "model",
        "model_not_found",
    )


def no_instance(role: str) -> APIError:
    return APIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"no healthy {role} instance is available; retry later",
        code="no_healthy_instance",
    )


def instance_failure(status: HTTPStatus, detail: str) -> APIError:
    """A failure on the instances as the client sees it: a status and a generic message, with
    ``detail`` (instance ids, addresses, their errors) kept for the log."""
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        return APIError(status, "the serving instances are overloaded; retry later", code="overloaded", detail=detail)
    return APIError(
        status, "the request failed on the serving instances; retry later", code="instance_failed", detail=detail
    )


def bearer_matches(authorization: str, api_key: str) -> bool:
    """``Authorization: Bearer <key>`` (REST header or gRPC metadata), compared in constant time."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())
