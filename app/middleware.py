"""ASGI middleware: request metrics, per-client rate limiting, the request-body size limit, the upload cap
with the pace a body must keep, the answer to a request the server's stop cut short, and each request's
deadline for the index server.

Plain ASGI (not ``BaseHTTPMiddleware``) so that bodies stream through untouched and a refusal is sent
before the body is read.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.clients import Clients
from app.errors import ApiError, busy_response, error_response, shutdown_response
from app.metrics import Metrics
from app.ratelimit import TokenBucketLimiter
from foundation.deadline import request_deadline
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


class IndexDeadlineMiddleware:
    """Every request's calls to the index server (Milvus) share ``seconds`` in all (``foundation.deadline``),
    counted from when its body has arrived: past it they fail, and the request gets 503
    ``index_unavailable``, never a longer wait."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with request_deadline(self.seconds) as deadline:

            async def receive_then_start() -> Message:
                message = await receive()
                if deadline is not None and not message.get("more_body", False):
                    deadline.start()  # the whole body is in (or the client left)
                return message

            await self.app(scope, receive_then_start, send)


class RateLimitMiddleware:
    """429 with ``Retry-After`` once a client exceeds its token bucket on paths under ``prefix``.

    A client is :meth:`app.clients.Clients.key`'s: key holders behind one proxy share a bucket, a made-up
    key gets none of its own, and the addresses of one network (an IPv6 /64) share one.
    """

    def __init__(
        self,
        app: ASGIApp,
        limiter: TokenBucketLimiter,
        metrics: Metrics,
        clients: Clients,
        prefix: str = "/v1/",
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.metrics = metrics
        self.clients = clients
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            wait = self.limiter.acquire(self.clients.key(scope))
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


@dataclass(frozen=True)
class BodyPace:
    """How fast a request body must arrive (Apache's ``mod_reqtimeout`` rule, whose ``MinRate`` it is).

    A body may be late by ``allowance`` seconds (0: no bound): each ``min_rate`` bytes received buy one more
    second, so a body that keeps the rate is never cut by it, and one that trickles a byte every 20 s is
    cut once its allowance is spent. ``deadline`` bounds the whole body however fast it comes (0: none).
    """

    min_rate: int  # bytes per second; 0: no minimum
    allowance: float
    deadline: float

    def due(self, body: BodyProgress) -> float:
        """The loop time by which ``body`` must have received more."""
        due = math.inf
        if self.min_rate and self.allowance:
            due = body.started + self.allowance + body.received / self.min_rate
        if self.deadline:
            due = min(due, body.started + self.deadline)
        return due

    def behind(self, body: BodyProgress, now: float) -> float:
        """Seconds ``body`` is behind the minimum rate (0 or less: keeping it)."""
        return (now - body.started) - body.received / self.min_rate if self.min_rate else 0.0

    def refusal(self, body: BodyProgress, now: float) -> StarletteHTTPException:
        if self.deadline and now >= body.started + self.deadline:
            why = f"the request body did not arrive within its deadline of {self.deadline:g} s"
        else:
            why = (
                f"the request body arrived under the minimum rate of {self.min_rate} bytes/s "
                f"({body.received} bytes in {now - body.started:.1f} s)"
            )
        return StarletteHTTPException(408, why, headers={"Connection": "close"})


@dataclass(eq=False)
class BodyProgress:
    started: float  # loop time of the request's start (its headers were in)
    received: int = 0
    complete: bool = False
    cut: bool = False  # its slot went to another upload
    timer: asyncio.Timeout | None = None  # while the app waits for more of it


class UploadSlots:
    """The bodies being received, or held while their request runs: at most ``limit`` at once.

    Bodies are what a server buffers (up to ``max_request_bytes`` each), so this caps upload memory. A
    body that is behind the minimum rate holds a slot only while nobody else needs it: when every slot is
    held, the one furthest behind gives its slot to the new upload (and gets its 408 at once). Otherwise
    8 clients sending a byte every 20 s kept every upload out.
    """

    def __init__(self, limit: int, pace: BodyPace) -> None:
        self.limit = limit
        self.pace = pace
        self.bodies: list[BodyProgress] = []  # one event loop: no await between a check and its change

    def take(self) -> BodyProgress | None:
        """A slot for a new upload, freeing one from a body behind the rate if need be; None when all are
        held by bodies that keep it (or are in)."""
        now = asyncio.get_running_loop().time()
        if len(self.bodies) >= self.limit:
            late = [body for body in self.bodies if not body.complete and not body.cut]
            furthest = max(late, key=lambda body: self.pace.behind(body, now), default=None)
            if furthest is None or self.pace.behind(furthest, now) <= 0:
                return None
            furthest.cut = True
            if furthest.timer is not None:  # it waits for its next bytes: end the wait now
                furthest.timer.reschedule(now)
            self.bodies.remove(furthest)
        body = BodyProgress(started=now)
        self.bodies.append(body)
        return body

    def give_back(self, body: BodyProgress) -> None:
        if body in self.bodies:
            self.bodies.remove(body)

    def full(self) -> bool:
        """Whether a new upload would be refused now."""
        now = asyncio.get_running_loop().time()
        held = [body for body in self.bodies if body.complete or self.pace.behind(body, now) <= 0]
        return len(self.bodies) >= self.limit and len(held) == len(self.bodies)


class UploadLimitMiddleware:
    """Requests with a body take one of the :class:`UploadSlots` (none free: 503 with ``Retry-After``), and
    their body must arrive at its :class:`BodyPace` (else 408 ``request_timeout``, the connection closed).
    Requests without a body are not counted."""

    def __init__(self, app: ASGIApp, slots: UploadSlots) -> None:
        self.app = app
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if not has_body:
            await self.app(scope, receive, send)
            return
        body = self.slots.take()
        if body is None:
            await busy_response("uploads in progress")(scope, receive, send)
            return
        pace = self.slots.pace

        async def paced_receive() -> Message:
            if body.complete:  # only a disconnect can come now
                return await receive()
            loop = asyncio.get_running_loop()
            if body.cut or pace.due(body) <= loop.time():
                raise pace.refusal(body, loop.time())
            try:
                async with asyncio.timeout_at(pace.due(body)) as body.timer:
                    message = await receive()
            except TimeoutError:
                raise pace.refusal(body, loop.time()) from None
            finally:
                body.timer = None
            if message["type"] == "http.request":
                body.received += len(message.get("body", b""))
                body.complete = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, paced_receive, send)
        finally:
            self.slots.give_back(body)


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
