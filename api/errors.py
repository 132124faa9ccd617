"""The one place where domain errors become HTTP responses."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from atomd.errors import (
    AtomdError,
    CheckpointError,
    ConfigError,
    DataError,
    JobConflictError,
    MessageError,
    NotFoundError,
    PeerAuthError,
    RateLimitedError,
    SpecError,
    TooLargeError,
    UnauthorizedError,
    WireError,
)
from atomd_api.schemas import ErrorBody

# Most specific first.
_STATUS: list[tuple[type[AtomdError], int, str]] = [
    (NotFoundError, 404, "not_found"),
    (JobConflictError, 409, "conflict"),
    (UnauthorizedError, 401, "unauthorized"),
    (ConfigError, 422, "invalid"),
    (MessageError, 422, "invalid"),
    (TooLargeError, 413, "too_large"),
    (RateLimitedError, 429, "rate_limited"),
    (DataError, 422, "invalid"),
    (CheckpointError, 409, "conflict"),
]


def status_of(exc: AtomdError) -> tuple[int, str]:
    if isinstance(exc, PeerAuthError):
        # The verifier decides: 401 the request is not authentic, 403 the peer is not admitted.
        return exc.status, "unauthorized" if exc.status == 401 else "forbidden"
    if isinstance(exc, WireError):  # a refused delta frame; the reason code is in the detail
        return (413, "too_large") if exc.reason == "oversize" else (422, "refused")
    for cls, code, kind in _STATUS:
        if isinstance(exc, cls):
            return code, kind
    return 500, "internal"


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI documentation of the error codes a route can answer."""
    return {code: {"model": ErrorBody, "description": "error"} for code in codes}


def _json_safe(value: Any) -> Any:
    """What a request sent, made JSON-encodable: NaN and infinities as strings (a 422 that
    echoes ``{"lr": NaN}`` back would otherwise fail to encode and become a 500)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def install(app: FastAPI) -> None:
    async def handle_validation(request: Request, exc: Exception) -> JSONResponse:
        # FastAPI's own 422 shape (each field and its reason), with what was sent made safe.
        assert isinstance(exc, RequestValidationError)
        errors = []
        for e in exc.errors():
            safe = {**e, "input": _json_safe(e.get("input"))}
            if "ctx" in e:
                safe["ctx"] = _json_safe(e["ctx"])
            errors.append(safe)
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, AtomdError)
        if isinstance(exc, SpecError):
            # The same shape as FastAPI's own 422: the field and the reason.
            error = {"type": "value_error", "loc": ["body", exc.field], "msg": str(exc)}
            return JSONResponse({"detail": [error]}, status_code=422)
        code, kind = status_of(exc)
        scheme = "Atomd-Signature" if isinstance(exc, PeerAuthError) else "Bearer"
        headers = {"WWW-Authenticate": scheme} if code == 401 else None
        if isinstance(exc, RateLimitedError):
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        body = ErrorBody(error=kind, detail=str(exc)).model_dump()
        return JSONResponse(body, status_code=code, headers=headers)

    async def handle_http(request: Request, exc: Exception) -> JSONResponse:
        # Framework errors (unparsable body, unknown route, wrong method) in the same shape.
        assert isinstance(exc, HTTPException)
        kinds = {
            400: "invalid",
            401: "unauthorized",
            404: "not_found",
            405: "invalid",
            413: "too_large",
            429: "rate_limited",
        }
        body = ErrorBody(error=kinds.get(exc.status_code, "invalid"), detail=str(exc.detail))
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(RequestValidationError, handle_validation)
    app.add_exception_handler(AtomdError, handle)
    app.add_exception_handler(HTTPException, handle_http)
