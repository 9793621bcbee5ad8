"""A bound on how many queries decode and embed at once, so that the event loop keeps its share of the CPU.

Without it every request gets a worker thread at once. In ``bench/load.py`` (16 clients, 2 shared cores)
16 model runs then time-sliced the CPU (the embed stage took ~124 ms instead of ~43 ms with two at a
time) and the event loop thread, which receives uploads and sends answers, starved: a 12-MP upload took
~0.6 s just to arrive, against ~20 ms with the bound. With as many slots as cores, extra requests wait in
line without using the CPU (the "queue" stage of a response's timings), at the same throughput.

The slots are shared out fairly between clients (``app.clients``: an API key, or an address): one client
holds at most ``share`` of them (half, by default) and waits for its own to end past that, so that a client
sending costly decodes (a batch of 64 images that each take seconds, several at once) never holds every
slot while another's search waits behind them. Among those that may take a free slot, the longest waiting
takes it.

A request waits for a slot no longer than its deadline (``foundation.deadline``: the API's
``index_deadline_seconds``, counted from when its body arrived): past it, 503 ``deadline_exceeded``, so that
slots held by searches hung on an index server (a Milvus that stopped answering) do not make every request
behind them overrun the deadline as well.

A request whose client goes away stops: a decode under way has its process ended (``engine.decode.pool``),
and work not yet started does not start, so the slot is free again at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import ParamSpec, TypeVar

import anyio.to_thread
from starlette.requests import Request

from app.clients import client_key
from engine.decode.pool import DecodeCancelledError, cancelled_by
from foundation.deadline import time_left
from foundation.errors import DmlsearchError, ErrorKind

# How often a request whose work is under way checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.2
P = ParamSpec("P")
T = TypeVar("T")


class SlotWaitTimeoutError(DmlsearchError, TimeoutError):
    """The request's deadline passed while it waited for a compute slot."""

    kind = ErrorKind.UNAVAILABLE
    code = "deadline_exceeded"


def default_slots() -> int:
    """The CPU cores this process may use (a container's CPU set, not the host's core count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_share(slots: int) -> int:
    """The slots one client may hold unless told: half of them (one of two), at least one."""
    return max(1, slots // 2)


class ComputeSlots:
    """Run blocking CPU work in worker threads, at most ``slots`` at a time and at most ``share`` of them
    for one client (``api_key``: the configured key, whose holders are one client). Create and use inside
    the event loop (the counts need no lock there)."""

    def __init__(self, slots: int, share: int = 0, api_key: str | None = None) -> None:
        if slots < 1 or share < 0:
            raise ValueError(f"compute slots need slots >= 1 and share >= 0, got {slots} and {share}")
        self.slots = slots
        self.share = min(share or default_share(slots), slots)
        self.api_key = api_key.encode() if api_key else None
        self.held: Counter[str] = Counter()  # slots held, by client
        self._waiting: deque[tuple[str, asyncio.Future[None]]] = deque()

    @property
    def in_use(self) -> int:
        return self.held.total()

    async def run(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, float]:
        """``function(*args, **kwargs)`` in a worker thread once a slot is free, for work no client asked
        for; also the ms spent waiting."""
        return await self._run("server", partial(function, *args, **kwargs))

    async def run_for(
        self, request: Request, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> tuple[T, float]:
        """:meth:`run` for ``request``, within its client's share: if its client disconnects, the work
        stops (raising :class:`DecodeCancelledError`) instead of holding the slot to its end."""
        gone = threading.Event()
        watcher = asyncio.create_task(_watch(request, gone))
        try:
            work = partial(_unless_gone, gone, partial(function, *args, **kwargs))
            return await self._run(client_key(request.scope, self.api_key), work)
        finally:
            watcher.cancel()

    async def _run(self, client: str, work: Callable[[], T]) -> tuple[T, float]:
        started = time.perf_counter()
        async with self._slot(client):
            queued_ms = (time.perf_counter() - started) * 1000.0
            return await anyio.to_thread.run_sync(work), queued_ms

    @asynccontextmanager
    async def _slot(self, client: str) -> AsyncIterator[None]:
        if self._admits(client):  # every waiter that could take a slot already has one
            self.held[client] += 1
        else:
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (client, granted)
            self._waiting.append(entry)
            left = time_left()
            try:
                async with asyncio.timeout(None if left is None else max(left, 0.0)):
                    await granted
            except BaseException as err:
                if granted.done() and not granted.cancelled():  # granted as it was cancelled
                    self._release(client)
                else:
                    self._waiting.remove(entry)
                if isinstance(err, TimeoutError):
                    raise SlotWaitTimeoutError(
                        f"the request's deadline passed while it waited for a compute slot "
                        f"({self.in_use} of {self.slots} held): retry later"
                    ) from None
                raise
        try:
            yield
        finally:
            self._release(client)

    def _admits(self, client: str) -> bool:
        return self.in_use < self.slots and self.held[client] < self.share

    def _release(self, client: str) -> None:
        self.held[client] -= 1
        if not self.held[client]:
            del self.held[client]
        for entry in list(self._waiting):  # the longest waiting first, skipping clients at their share
            waiter, granted = entry
            if not granted.done() and self._admits(waiter):  # done: cancelled, on its way out
                self._waiting.remove(entry)
                self.held[waiter] += 1
                granted.set_result(None)


async def _watch(request: Request, gone: threading.Event) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    gone.set()


def _unless_gone(gone: threading.Event, work: Callable[[], T]) -> T:
    if gone.is_set():  # it went away while the request waited for its slot
        raise DecodeCancelledError("the client went away")
    with cancelled_by(gone):
        return work()
