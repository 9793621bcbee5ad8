"""Every error leaves the API as ``{"error": {"code", "message"}}`` with a 4xx/5xx status."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from app.memory import release_memory
from engine.decode_pool import DecodeCancelledError, DecodePoolClosedError
from engine.explain import ExplainUnavailableError
from engine.images import ImageDecodeError
from engine.item_reader import ItemNotFoundError
from engine.item_writer import DuplicateItemError, InvalidItemError, StorageError
from engine.query import RerankUnavailableError
from index.filters import UnknownLabelError
from index.protocol import BackendUnavailableError

log = logging.getLogger("dmlsearch.app")

# Image problems the client can fix: a format we do not take is 415, an oversized image 413, one whose
# decode goes over its time or memory limit 422, the rest 400.
_IMAGE_ERROR_STATUS = {
    "unsupported_format": 415,
    "image_too_large": 413,
    "batch_too_large": 413,
    "image_too_costly": 422,
}
# Seconds a client is told to wait when the index's server (Milvus) failed its request.
INDEX_UNAVAILABLE_RETRY_AFTER = 5
# nginx's code for a request whose client closed the connection: nobody reads it, the access log does.
CLIENT_CLOSED_REQUEST = 499
# Seconds a client is told to wait after the server ran out of memory on its request.
OUT_OF_MEMORY_RETRY_AFTER = 5
# Codes for errors Starlette raises itself (unknown route, wrong method, unreadable multipart body).
_HTTP_ERROR_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"code": code, "message": message}}, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.code, err.message, err.headers)

    @app.exception_handler(ImageDecodeError)
    async def bad_image(_: Request, err: ImageDecodeError) -> JSONResponse:
        return error_response(_IMAGE_ERROR_STATUS.get(err.code, 400), err.code, err.message)

    @app.exception_handler(ItemNotFoundError)
    async def not_found(_: Request, err: ItemNotFoundError) -> JSONResponse:
        return error_response(404, "item_not_found", str(err))

    @app.exception_handler(RerankUnavailableError)
    async def rerank_unavailable(_: Request, err: RerankUnavailableError) -> JSONResponse:
        return error_response(422, "rerank_unavailable", str(err))

    @app.exception_handler(ExplainUnavailableError)
    async def explain_unavailable(_: Request, err: ExplainUnavailableError) -> JSONResponse:
        return error_response(422, "explain_unavailable", str(err))

    @app.exception_handler(UnknownLabelError)
    async def unknown_label(_: Request, err: UnknownLabelError) -> JSONResponse:
        return error_response(422, "unknown_label", str(err))

    @app.exception_handler(InvalidItemError)
    async def invalid_item(_: Request, err: InvalidItemError) -> JSONResponse:
        return error_response(422, "invalid_item", str(err))

    @app.exception_handler(DuplicateItemError)
    async def duplicate_item(_: Request, err: DuplicateItemError) -> JSONResponse:
        return error_response(409, "duplicate_item", str(err))

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

    @app.exception_handler(DecodeCancelledError)
    async def client_gone(_: Request, err: DecodeCancelledError) -> JSONResponse:
        return error_response(CLIENT_CLOSED_REQUEST, "client_closed_request", str(err))

    @app.exception_handler(DecodePoolClosedError)
    async def shutting_down(_: Request, err: DecodePoolClosedError) -> JSONResponse:
        return error_response(503, "shutting_down", str(err), headers={"Connection": "close"})

    @app.exception_handler(StorageError)
    async def storage_unavailable(request: Request, err: StorageError) -> JSONResponse:
        log.error("write refused on %s %s: %s", request.method, request.url.path, err)
        return error_response(503, "storage_unavailable", str(err))

    @app.exception_handler(BackendUnavailableError)
    async def index_unavailable(request: Request, err: BackendUnavailableError) -> JSONResponse:
        # The index's server (Milvus) failed or is down: not the client's fault, and not a bug here.
        log.error("index server failed on %s %s: %s", request.method, request.url.path, err)
        return error_response(
            503, "index_unavailable", str(err), headers={"Retry-After": str(INDEX_UNAVAILABLE_RETRY_AFTER)}
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
        details = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in err.errors()
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
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=err)
        return error_response(500, "internal_error", "internal server error")


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
