"""Error bodies of the REST API: every failure is ``{"error": code, "detail": ...}``.

One module so the status code of each failure is decided in one place: the
endpoints raise `ApiError` (or a `TrajstoreError` from the library) and the
handlers `install_error_handlers` adds turn them into the documented bodies.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trajstore.errors import (
    BundleError,
    IntegrityError,
    NotFoundError,
    SelectionError,
    StoreError,
    TrajstoreError,
    UsageError,
)

from . import models

#: the error responses every operation documents (OpenAPI ``responses``)
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": models.ErrorResponse, "description": why}
    for code, why in (
        (400, "bad filter or selector"),
        (401, "missing or wrong bearer token"),
        (404, "unknown run, step, bundle or payload"),
        (409, "the stored bundle cannot serve this request"),
        (413, "request body over 4 MiB"),
        (422, "malformed parameter"),
        (503, "the replay queue is full (busy) or the store cannot be read (store_error)"),
    )
}

#: library errors -> (status, code), first match wins (subclasses first)
_TRAJSTORE_STATUS: tuple[tuple[type[TrajstoreError], int, str], ...] = (
    (NotFoundError, 404, "not_found"),
    (SelectionError, 400, "bad_selection"),
    (UsageError, 400, "bad_request"),
    (BundleError, 409, "bundle_error"),
    (IntegrityError, 500, "integrity_error"),
    (StoreError, 503, "store_error"),
)


class ApiError(HTTPException):
    """An HTTP failure with its machine-readable ``error`` code."""

    def __init__(self, status: int, code: str, detail: Any) -> None:
        super().__init__(status, detail)
        self.code = code


#: a string detail is cut to this many characters: a library message may quote the request
#: (a replay selection of 10 MB ids came back whole)
MAX_DETAIL_CHARS = 2000


def error_response(
    status: int, code: str, detail: Any, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The documented error body."""
    if isinstance(detail, str) and len(detail) > MAX_DETAIL_CHARS:
        detail = detail[:MAX_DETAIL_CHARS] + f"... ({len(detail)} characters)"
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status_code, exc.code, exc.detail)


def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, exc.detail, getattr(exc, "headers", None))


def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [
        {
            "loc": list(error.get("loc", ())),
            "msg": str(error.get("msg", "")),
            "type": str(error.get("type", "")),
        }
        for error in exc.errors()
    ]
    return error_response(422, "invalid_request", errors)


def _trajstore(_: Request, exc: TrajstoreError) -> JSONResponse:
    for error_class, status, code in _TRAJSTORE_STATUS:
        if isinstance(exc, error_class):
            return error_response(status, code, str(exc))
    return error_response(400, "bad_request", str(exc))


def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Starlette still re-raises it after this answer, so uvicorn logs the traceback
    return error_response(500, "internal_error", f"{type(exc).__name__} (see the server log)")


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through `error_response` (a bug too: JSON 500, never plain text)."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(TrajstoreError, _trajstore)
    app.add_exception_handler(Exception, _unexpected)
