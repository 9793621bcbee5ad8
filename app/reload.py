"""Switch a running server to another index directory (and the model it carries) without dropping a request.

The new engine (embedder, PDDM unit and index, one :class:`SearchService`) is loaded and tried beside the
served one; then one reference assignment swaps it in. Each request takes the engine once, when it starts
(``app.deps.ready_service``), so queries in flight finish on the old engine, which is freed when the last
of them lets go of it; new requests get the new one, and ``/readyz`` never stops answering 200. A load
that fails leaves the served engine as it was and says why. Triggered by ``POST /v1/admin/reload`` or by
SIGHUP, which reloads the configured index path (a symlink the operator repointed, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from app.state import EngineState

log = logging.getLogger("dmlsearch.app")


class ReloadError(Exception):
    """The new index could not be loaded: the served one stays."""


@dataclass(frozen=True)
class Reloaded:
    index_path: Path
    model_fingerprint: str
    previous_model_fingerprint: str | None
    count: int
    took_ms: float


class Reloader:
    """Loads and swaps in engines for one app, one reload at a time."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._lock = threading.Lock()  # two reloads at once would race for the last word

    def reload(self, index_path: Path | None = None, model_path: Path | None = None) -> Reloaded:
        """Load ``index_path`` (default: the configured one) and swap it in; raises :class:`ReloadError`.

        ``model_path`` None: the model the index carries (the configured model for the configured path).
        """
        started = time.perf_counter()
        where = index_path or self.app.state.settings.index_path
        with self._lock:
            try:
                fresh = EngineState.open(
                    self.app.state.settings, index_path, model_path, decoder=self.app.state.decoder
                )
                _try(fresh)
            except Exception as err:  # whatever is wrong with the new index, keep serving the old one
                log.error("reload of %s failed, still serving the loaded index: %s", where, err)
                raise ReloadError(f"{type(err).__name__}: {err}") from err
            previous = self.app.state.engine.service
            self.app.state.engine = fresh  # the swap: one reference, model + PDDM unit + index together
        service = fresh.service
        result = Reloaded(
            index_path=Path(where),
            model_fingerprint=service.model_fingerprint,
            previous_model_fingerprint=previous.model_fingerprint if previous is not None else None,
            count=len(service.index),
            took_ms=(time.perf_counter() - started) * 1000.0,
        )
        log.info(
            "reloaded %s: model %s, %d items (%.0f ms)",
            where,
            result.model_fingerprint[:12],
            result.count,
            result.took_ms,
        )
        return result


def _try(state: EngineState) -> None:
    """One search through the new index, so a truncated or half-built one fails here, not in a query."""
    service = state.service
    service.index.search(np.zeros((1, service.embedder.dim), dtype=np.float32), 1)


def reload_on_sighup(reloader: Reloader) -> Callable[[], None]:
    """SIGHUP reloads the configured index path; returns the function that stops listening.

    Signals reach only the main thread's event loop (uvicorn's): elsewhere (an in-process test client)
    and on platforms without SIGHUP this does nothing.
    """
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    async def reload() -> None:
        with contextlib.suppress(ReloadError):  # logged by the reloader
            await run_in_threadpool(reloader.reload)

    def on_sighup() -> None:
        log.info("SIGHUP: reloading the configured index")
        task = loop.create_task(reload())
        tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    return lambda: loop.remove_signal_handler(signal.SIGHUP)
