"""The uvicorn server behind ``dmlsearch serve``: clean signal handling and limits on slow or many clients.

uvicorn already stops accepting and drains requests on SIGTERM/SIGINT, closes idle keep-alive connections
and can cancel what is left after a grace period (``timeout_graceful_shutdown``). What it lacks, added here:

- exit code 0 after a requested stop (uvicorn re-raises the signal after shutting down, so SIGTERM ended
  with 143 and supervisors logged a clean stop as a crash);
- a header read timeout (uvicorn has none: a slowloris client trickling headers kept its connection for
  ever) and a body idle timeout (an upload that stops arriving held its buffered body);
- a cap on connections answered ``503`` with ``Retry-After`` (uvicorn's ``limit_concurrency`` sends no
  ``Retry-After``, so clients cannot tell when to come back).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import HANDLED_SIGNALS

from app.errors import busy_response
from app.settings import Settings

log = logging.getLogger("dmlsearch.app")
# The parent of every logger the server writes to (dmlsearch.app, dmlsearch.index).
SERVER_LOGGER = "dmlsearch"


def _raw_error(status_line: str, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response in the API's error format, for the protocol to write itself."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = f"HTTP/1.1 {status_line}\r\ncontent-type: application/json\r\nconnection: close\r\n"
    return head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body


_REQUEST_TIMEOUT = _raw_error("408 Request Timeout", "request_timeout", "the request arrived too slowly")


async def _too_many_connections(scope: Scope, receive: Receive, send: Send) -> None:
    await busy_response("connections")(scope, receive, send)


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with read timeouts and a connection cap (class attributes, set per server).

    A connection must deliver a request's headers within ``header_timeout`` of opening (or of its first
    byte after a keep-alive pause, which uvicorn's keep-alive timeout bounds), and a body may pause at
    most ``body_timeout`` between chunks. Past that it gets a 408 (if no response started) and is closed,
    which also frees its buffered body.
    """

    header_timeout: float = 0.0
    body_timeout: float = 0.0
    max_connections: int = 0

    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            self.app = _too_many_connections  # this connection only: answered 503, then closed
        self._arm(self.header_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_timer is None:  # a new request on a kept-alive connection: its headers are timed
            self._arm(self.header_timeout)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._arm(self.body_timeout)  # disarmed at once by on_message_complete when there is no body

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm(self.body_timeout)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        if seconds > 0:
            self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # we stopped reading (the app is behind), not the client: not its fault
            self._arm(self.body_timeout)
            return
        log.warning("closing a connection from %s: request not received in time", _address(self.client))
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()  # the app's receive() then reports a disconnect, dropping the partial body


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"


class GracefulServer(uvicorn.Server):
    """A uvicorn server that exits with code 0 after SIGTERM or SIGINT: a requested stop is a clean one.

    The shutdown itself is uvicorn's: stop accepting, let in-flight requests finish for at most
    ``timeout_graceful_shutdown`` seconds, then cancel them and close their connections. A second
    SIGINT forces the exit at once, as in uvicorn.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
        # uvicorn re-raises the captured signal here, so the process dies of it (code 143 for SIGTERM).


def log_config() -> dict:
    """uvicorn's logging setup plus the ``dmlsearch`` loggers at INFO on its stderr handler: without it,
    what the server does on its own (a reload by API or SIGHUP, the index poller) went unlogged, as
    Python drops INFO records of loggers nobody configured."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"][SERVER_LOGGER] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def run_server(app: ASGIApp, settings: Settings, **uvicorn_options: Any) -> None:
    """Serve ``app`` under the connection limits and shutdown grace of ``settings``; returns after a stop."""
    protocol = type(
        "ServeProtocol",
        (TimedHttpProtocol,),
        {
            "header_timeout": settings.header_timeout_seconds,
            "body_timeout": settings.body_timeout_seconds,
            "max_connections": settings.max_connections,
        },
    )
    config = uvicorn.Config(
        app,
        http=protocol,
        timeout_keep_alive=settings.keep_alive_seconds,
        # uvicorn annotates an int, but waits with asyncio.wait_for, which takes fractions of seconds too.
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,  # type: ignore[arg-type]
        log_config=log_config(),
        **uvicorn_options,
    )
    GracefulServer(config).run()
