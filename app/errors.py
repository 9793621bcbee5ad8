"""Every error leaves the API as ``{"error": {"code", "message"}}`` with a 4xx/5xx status."""

from __future__ import annotations

import logging
import traceback
import uuid
from collections.abc import Iterator, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from app.memory import release_memory
from foundation.errors import DmlsearchError, ErrorKind

log = logging.getLogger("dmlsearch.app")

# Seconds a client is told to wait when the index's server (Milvus) failed its request.
INDEX_UNAVAILABLE_RETRY_AFTER = 5
# nginx's code for a request whose client closed the connection: nobody reads it, the access log does.
CLIENT_CLOSED_REQUEST = 499
# Seconds a client is told to wait after the server ran out of memory on its request.
OUT_OF_MEMORY_RETRY_AFTER = 5
# The HTTP status of each kind of error (foundation/errors.py).
KIND_STATUS = {
    ErrorKind.INVALID: 422,
    ErrorKind.MALFORMED: 400,
    ErrorKind.UNSUPPORTED: 415,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.CANCELLED: CLIENT_CLOSED_REQUEST,
    ErrorKind.UNAVAILABLE: 503,
}
# Headers some errors answer with: when to come back, or that this connection ends (the server stops).
_ERROR_HEADERS = {
    "index_unavailable": {"Retry-After": str(INDEX_UNAVAILABLE_RETRY_AFTER)},
    "shutting_down": {"Connection": "close"},
    # Every compute slot was held past the request's deadline (hung index calls, a burst): load, not the
    # request's fault.
    "deadline_exceeded": {"Retry-After": str(INDEX_UNAVAILABLE_RETRY_AFTER)},
    "preempted": {"Retry-After": str(INDEX_UNAVAILABLE_RETRY_AFTER)},
    # Images reach the model at its input size and runs are bounded in images, so an overrun is the
    # server's state (load, a slow model), not the request's: the run stopped, its slot free.
    "embed_timeout": {"Retry-After": str(OUT_OF_MEMORY_RETRY_AFTER)},
}
# Errors that are the server's trouble, not the client's: logged, with what failed.
_LOGGED_ERRORS = {
    "storage_unavailable": "write refused",
    "index_unavailable": "index server failed",  # the index's server (Milvus), not a bug here
    "embed_timeout": "embedding stopped",
}
# Codes for errors Starlette raises itself (unknown route, wrong method, unreadable multipart body).
_HTTP_ERROR_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",  # a body under the minimum rate or past its deadline (app.middleware)
    413: "request_too_large",
}


class ApiError(DmlsearchError):
    """An error found by the API layer itself (limits, keys, request shape), with its own kind."""

    def __init__(self, kind: ErrorKind, code: str, message: str) -> None:
        super().__init__(message, code=code)
        self.kind = kind


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"code": code, "message": message}}, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(DmlsearchError)
    async def domain_error(request: Request, err: DmlsearchError) -> JSONResponse:
        # The one answer to every error the user can act on: the status of its kind, its code, its message.
        if err.code in _LOGGED_ERRORS:
            log.error("%s on %s %s: %s", _LOGGED_ERRORS[err.code], request.method, request.url.path, err)
        return error_response(KIND_STATUS[err.kind], err.code, err.message, _ERROR_HEADERS.get(err.code))

    @app.exception_handler(MemoryError)
    async def out_of_memory(request: Request, err: MemoryError) -> JSONResponse:
        # The server's limit, not the client's fault (never 400/500): free what the request held
        # (the failed frames' locals keep its arrays alive) and let the client come back.
        log.error(
            "out of memory on %s %s: %s", request.method, request.url.path, str(err) or type(err).__name__
        )
        traceback.clear_frames(err.__traceback__)
        release_memory()
        return error_response(
            503,
            "out_of_memory",
            "the server does not have the memory for this request now: retry later, or send smaller images",
            headers={"Retry-After": str(OUT_OF_MEMORY_RETRY_AFTER)},
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        broken = next((error for error in errors if error["type"] == "json_invalid"), None)
        if broken is not None:  # Pydantic says "body.12: JSON decode error": say where and what
            where, why = broken["loc"][-1], broken.get("ctx", {}).get("error", "")
            return error_response(
                422,
                "invalid_request",
                f"the request body is not valid JSON: {why} (at character {where}); send it with "
                "Content-Type: application/json",
            )
        details = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in errors
        )
        return error_response(422, "invalid_request", details)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_ERROR_CODES.get(err.status_code, "http_error")
        headers = err.headers
        if err.status_code == 405:  # Starlette names the methods of the first route on the path only
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(app, request))}
        return error_response(err.status_code, code, str(err.detail), headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        # A bug, not bad input: log the traceback, tell the client only that it was our fault.
        error_id = uuid.uuid4().hex[:12]
        log.exception("unhandled error %s on %s %s", error_id, request.method, request.url.path, exc_info=err)
        return error_response(500, "internal_error", f"internal server error (error id {error_id})")


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route answers on the request's path."""
    methods: set[str] = set()
    for route in _leaf_routes(app.router.routes):
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def _leaf_routes(routes: Sequence[BaseRoute]) -> Iterator[BaseRoute]:
    """The routes themselves, through the routers FastAPI wraps included routers in."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _leaf_routes(included.routes)
        else:
            yield route


# Seconds a client refused for load (too many connections or uploads) is told to wait before retrying.
BUSY_RETRY_AFTER_S = 1


def busy_response(what: str) -> JSONResponse:
    """The 503 a client over a load cap gets: ``Retry-After`` and ``Connection: close``."""
    return error_response(
        503,
        "busy",
        f"too many {what}: retry after {BUSY_RETRY_AFTER_S} s",
        headers={"Retry-After": str(BUSY_RETRY_AFTER_S), "Connection": "close"},
    )


def shutdown_response() -> JSONResponse:
    """The 503 of a request the server's stop cut short (past its shutdown grace)."""
    return error_response(
        503,
        "shutting_down",
        "the server stopped before this request was answered: retry",
        _ERROR_HEADERS["shutting_down"],
    )
