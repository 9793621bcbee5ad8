"""A bound on how many queries decode and embed at once, so that the event loop keeps its share of the CPU.

Without it every request gets a worker thread at once. In ``bench/load.py`` (16 clients, 2 shared cores)
16 model runs then time-sliced the CPU (the embed stage took ~124 ms instead of ~43 ms with two at a
time) and the event loop thread, which receives uploads and sends answers, starved: a 12-MP upload took
~0.6 s just to arrive, against ~20 ms with the bound. With as many slots as cores, extra requests wait in
line without using the CPU (the "queue" stage of a response's timings), at the same throughput.

A request whose client goes away stops: a decode under way has its process ended (``engine.decode.pool``),
and work not yet started does not start, so the slot is free again at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import ParamSpec, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from starlette.requests import Request

from engine.decode.pool import DecodeCancelledError, cancelled_by

# How often a request whose work is under way checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.2
P = ParamSpec("P")
T = TypeVar("T")


def default_slots() -> int:
    """The CPU cores this process may use (a container's CPU set, not the host's core count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ComputeSlots:
    """Run blocking CPU work in worker threads, at most ``slots`` at a time. Create inside the event loop."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.limiter = CapacityLimiter(slots)

    async def run(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, float]:
        """``function(*args, **kwargs)`` in a worker thread once a slot is free; also the ms spent waiting."""
        started = time.perf_counter()
        async with self.limiter:
            queued_ms = (time.perf_counter() - started) * 1000.0
            return await anyio.to_thread.run_sync(partial(function, *args, **kwargs)), queued_ms

    async def run_for(
        self, request: Request, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> tuple[T, float]:
        """:meth:`run` for ``request``: if its client disconnects, the work stops (raising
        :class:`DecodeCancelledError`) instead of holding the slot to its end."""
        gone = threading.Event()
        watcher = asyncio.create_task(_watch(request, gone))
        try:
            return await self.run(_unless_gone, gone, partial(function, *args, **kwargs))
        finally:
            watcher.cancel()


async def _watch(request: Request, gone: threading.Event) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    gone.set()


def _unless_gone(gone: threading.Event, work: Callable[[], T]) -> T:
    if gone.is_set():  # it went away while the request waited for its slot
        raise DecodeCancelledError("the client went away")
    with cancelled_by(gone):
        return work()
