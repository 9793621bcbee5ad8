"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.concurrency import run_in_threadpool

from app.access_log import redact_access_log
from app.compute import ComputeSlots, default_slots
from app.context import AppContext
from app.errors import install_error_handlers
from app.memory import return_freed_blocks
from app.metrics import Metrics
from app.middleware import (
    BodySizeLimitMiddleware,
    IndexDeadlineMiddleware,
    RateLimitMiddleware,
    RequestMetricsMiddleware,
    ShutdownAnswerMiddleware,
    UploadLimitMiddleware,
    UploadSlots,
)
from app.openapi import served_openapi
from app.ratelimit import TokenBucketLimiter
from app.reload import ReloadError, reload_on_sighup
from app.routes import router
from app.settings import Settings
from app.state import EngineState
from engine.decode.pool import DecodePool
from engine.model.model_card import Preprocessing
from foundation import defaults

log = logging.getLogger("dmlsearch.app")


DirectoryState = frozenset[tuple[str, int, int]] | None


def _directory_state(directory: Path) -> DirectoryState:
    """Each file of ``directory`` with its modification time and size (None: no such directory): what
    changes when an index is copied, moved or saved into it."""
    try:
        with os.scandir(directory) as entries:
            return frozenset((entry.name, *_stamp(entry)) for entry in entries)
    except OSError:
        return None


def _stamp(entry: os.DirEntry) -> tuple[int, int]:
    try:
        status = entry.stat()
    except OSError:  # removed while listed
        return (0, -1)
    return (status.st_mtime_ns, status.st_size)


async def _poll_index(context: AppContext, seconds: float, tried: DirectoryState) -> None:
    """Serve the index again when another process saved it (see ``Reloader.refresh``); or load it where
    the start-up load failed: when the index's server (Milvus) was down, or, asked to wait for the index,
    once its directory changed since the last try (``tried``: what the start-up load saw)."""
    reloader, settings = context.reloader, context.settings
    while seconds > 0:
        await asyncio.sleep(seconds)
        if context.engine.service is None:
            now = _directory_state(settings.index_path) if settings.wait_for_index else tried
            if context.engine.index_server_down or now != tried:
                tried = now
                with contextlib.suppress(ReloadError):  # the reloader logs why
                    await run_in_threadpool(reloader.reload)
            continue
        try:
            await run_in_threadpool(reloader.refresh)
        except ReloadError as err:  # a save in progress or a bad index: keep serving the one loaded
            log.warning("index not reloaded: %s", err)


_INPUT_SIDE = Preprocessing().input_size  # a model card's input size unless it says another
API_DESCRIPTION = f"""\
**Memory budget per request**, checked before any pixel is decoded: at most `max_image_pixels` per image
({defaults.MAX_IMAGE_PIXELS / 1e6:g} MP by default) and `max_batch_pixels` per request in all
({defaults.MAX_BATCH_PIXELS / 1e6:g} MP; read from the image headers, JPEGs at the size they are decoded at):
413 `image_too_large` / `batch_too_large`. The image count is checked before any image is read (422
`too_many_images`).

**Extreme aspect ratios are accepted with a bounded resize**: only the region the centre crop keeps is
resampled, straight to the model input ({_INPUT_SIDE}x{_INPUT_SIDE} by default), so no image is ever upscaled
beyond it whatever its shape (a 1x100000 PNG costs what a small photo does).

Each image is decoded in a worker process under a CPU, wall-clock and memory limit (`decode_cpu_seconds`,
`decode_wall_seconds`, `decode_memory_mb`: what the decoder really allocates, whatever the header says);
past one, 422 `image_too_costly`. All the images of one request share a budget (`decode_request_cpu_seconds`,
`decode_request_wall_seconds`): past it the request is cut off, 422 `request_too_costly` naming the image
that ran out. One client (its API key, else its address) holds at most `client_compute_slots` of the
compute slots (half, by default); a free slot goes to the waiting client that holds the fewest, and a
request that held its slot `compute_quantum_seconds` while another client waits goes on in the background,
its decodes at the lowest CPU priority, so that a normal search is not held up by costly ones; where the
background is full too, the request longest in it is stopped for a client with nothing under way, 503
`preempted` (a client so stopped may run its retry longer before it is stopped again). A gallery
file that needs more memory than a decode may use is 503 `out_of_memory` (the server's own file, not the
request's fault). A client that disconnects ends its
decode. Running out of memory anywhere else is 503 `out_of_memory` with `Retry-After`; a read-only or
full index folder makes writes 503 `storage_unavailable`, searches go on.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The API over one model and one index, both loaded once at start-up and shared by all requests."""
    settings = settings or Settings()
    EngineState.require_bundle(settings)  # nothing to serve: refused before any process starts
    metrics = Metrics()
    uploads = UploadSlots(settings.max_concurrent_uploads, settings.body_pace())
    context = AppContext(settings, metrics, uploads)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        return_freed_blocks()
        redact_access_log()
        slots = settings.compute_slots or default_slots()
        context.compute = ComputeSlots(
            slots,
            settings.client_compute_slots,
            settings.clients(),
            quantum=settings.compute_quantum_seconds,
            within_deadline=lambda: context.engine.on_index_server(),
        )
        # One decode process per request that may run at once (every decode holds a slot, in the
        # foreground or the background); started off the event loop, as their forkserver imports the
        # decoders (seconds).
        limits = settings.decode_limits()
        context.decoder = await run_in_threadpool(DecodePool, context.compute.most_at_once, limits)
        tried = _directory_state(settings.index_path)
        context.engine = await run_in_threadpool(EngineState.load, settings, decoder=context.decoder)
        poller = asyncio.create_task(_poll_index(context, settings.index_poll_seconds, tried))
        stop_sighup = reload_on_sighup(context.reloader)
        yield
        stop_sighup()
        poller.cancel()
        # After the grace period: decodes still running are ended (their requests were cancelled).
        context.decoder.close()
        if context.engine.service is not None:
            context.engine.service.close()

    app = FastAPI(
        title="dmlsearch",
        version="0.1.0",
        summary="Image search with deep-metric-learning embeddings.",
        description=API_DESCRIPTION,
        lifespan=lifespan,
    )
    context.store(app)
    metrics.track_index_size(lambda: context.engine.size())
    # Starlette wraps each new middleware around the previous ones: the last added runs first. CORS is
    # outermost so that refusals (413, 429) carry CORS headers too and browsers can read them.
    app.add_middleware(IndexDeadlineMiddleware, seconds=settings.index_deadline_seconds)
    app.add_middleware(BodySizeLimitMiddleware, limit=settings.max_request_bytes)
    app.add_middleware(UploadLimitMiddleware, slots=context.uploads)
    if settings.rate_limit_per_second > 0:
        app.add_middleware(
            RateLimitMiddleware,
            limiter=TokenBucketLimiter(settings.rate_limit_per_second, settings.rate_limit_burst),
            metrics=metrics,
            clients=settings.clients(),
        )
    app.add_middleware(ShutdownAnswerMiddleware)  # inside the metrics: they count its 503
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Content-Type", "X-API-Key"],
            expose_headers=["Retry-After"],
        )
    install_error_handlers(app)
    app.include_router(router)
    app.openapi = served_openapi(app)  # type: ignore[method-assign]
    return app
