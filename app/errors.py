"""Every error leaves the API as ``{"error": {"code", "message"}}`` with a 4xx/5xx status."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.images import ImageDecodeError


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.code, err.message)

    @app.exception_handler(ImageDecodeError)
    async def bad_image(_: Request, err: ImageDecodeError) -> JSONResponse:
        status = 413 if err.code == "image_too_large" else 415 if err.code == "unsupported_format" else 400
        return error_response(status, err.code, err.message)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
        details = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in err.errors()
        )
        return error_response(422, "invalid_request", details)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, "http_error", str(err.detail))
