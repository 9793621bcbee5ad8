"""ASGI middleware: request metrics, per-client rate limiting, the request-body size limit, the upload cap,
and the answer to a request the server's stop cut short.

Plain ASGI (not ``BaseHTTPMiddleware``) so that bodies stream through untouched and a refusal is sent
before the body is read.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError, busy_response, error_response, shutdown_response
from app.metrics import Metrics
from app.ratelimit import TokenBucketLimiter
from foundation.errors import ErrorKind

# Metric labels take only known methods: a client inventing methods must not invent time series.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class RequestMetricsMiddleware:
    """Observe every HTTP request's latency under its route template (``/v1/items/{item_id}``)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # stays 500 if the app raises before starting a response

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, record_status)
        finally:
            self.metrics.in_flight.dec()
            # The router stores the matched route in the scope; templates keep the label set small.
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.requests.labels(method, route, str(status)).observe(time.perf_counter() - started)


class RateLimitMiddleware:
    """429 with ``Retry-After`` once a client exceeds its token bucket on paths under ``prefix``.

    A client is its API key when it presents the configured one (so key holders behind one proxy
    share a bucket), else its address. Unknown keys do not get buckets of their own: otherwise a
    client could dodge the limit by sending a fresh made-up key with every request.
    """

    def __init__(
        self,
        app: ASGIApp,
        limiter: TokenBucketLimiter,
        metrics: Metrics,
        api_key: str | None,
        prefix: str = "/v1/",
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.prefix = prefix

    def client_key(self, scope: Scope) -> str:
        presented = dict(scope["headers"]).get(b"x-api-key")
        if (
            self.api_key is not None
            and presented is not None
            and secrets.compare_digest(presented, self.api_key)
        ):
            return "api-key"
        client = scope.get("client")
        return f"address:{client[0] if client else 'unknown'}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            wait = self.limiter.acquire(self.client_key(scope))
            if wait > 0:
                self.metrics.rate_limited.inc()
                retry_after = str(max(1, math.ceil(wait)))
                response = error_response(
                    429,
                    "rate_limited",
                    f"too many requests: retry after {retry_after} s",
                    headers={"Retry-After": retry_after},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse bodies over ``limit`` bytes: by ``Content-Length`` up front, else while they stream in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            status, code = (413, "request_too_large") if declared.isdigit() else (400, "bad_request")
            response = error_response(status, code, f"the request body must be at most {self.limit} bytes")
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # a chunked body that lied by omission
                    raise ApiError(
                        ErrorKind.TOO_LARGE,
                        "request_too_large",
                        f"the request body is over {self.limit} bytes",
                    )
            return message

        await self.app(scope, limited_receive, send)


class UploadLimitMiddleware:
    """At most ``limit`` requests with a body in flight; more are answered 503 with ``Retry-After``.

    Bodies are what a server buffers (up to ``max_request_bytes`` each), so this caps upload memory;
    requests without a body are not counted.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.active = 0  # one event loop: no await between the check and the increment

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if not has_body:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            await busy_response("uploads in progress")(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class ShutdownAnswerMiddleware:
    """A request still unanswered when the shutdown grace ends gets 503 ``shutting_down`` in the API's
    error format. uvicorn cancels such requests and answers them itself with a plain-text 500
    ``Internal Server Error``: a server error in a shape no client of the API reads, for what is a stop."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not started:  # once started, only closing the connection can tell the client
                await shutdown_response()(scope, receive, send)
            raise  # the cancelled task ends as uvicorn expects; its answer is sent already
