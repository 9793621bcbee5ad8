"""A bound on how many queries decode and embed at once, so that the event loop keeps its share of the CPU.

Without it every request gets a worker thread at once. In ``bench/load.py`` (16 clients, 2 shared cores)
16 model runs then time-sliced the CPU (the embed stage took ~124 ms instead of ~43 ms with two at a
time) and the event loop thread, which receives uploads and sends answers, starved: a 12-MP upload took
~0.6 s just to arrive, against ~20 ms with the bound. With as many slots as cores, extra requests wait in
line without using the CPU (the "queue" stage of a response's timings), at the same throughput.

The slots are shared out fairly between clients (``app.clients``: an API key, or an address's network, an
IPv6 /64 by default):
- one client holds at most ``share`` of them (half, by default) and waits for its own to end past that;
- a free slot goes to the waiting client that holds the fewest (one with nothing under way first), the
  longest waiting among equals: round robin by client, not first come first served;
- a request that has held its slot for ``quantum`` seconds while another client waits gives it up: it goes
  on in the background, its decodes at the lowest CPU priority (``foundation.priority.lowered_by``), and the
  waiter takes the slot. At most ``background`` requests run so, each with a decode process of its own;
- where the background is full too and a client with nothing under way waits, a request is stopped, as if
  its client had gone away, and answered 503 ``preempted`` with Retry-After: the one whose time is up
  first (``PREEMPT_AFTER_QUANTA`` quanta since it took its slot; the background's first among equals).
  More clients sending costly work at once than the server runs cannot keep a new client waiting for
  their decodes' limits;
- a client whose request was stopped so is owed: its next request (its retry, within ``OWED_SECONDS``)
  may be stopped only after twice as long, four times after a second stop in a row, and so on up to
  ``2**OWED_DOUBLINGS`` times (reset once one of its requests ends unstopped); it is not lowered in the
  background; and while it waits it stops nobody. At most ``background`` requests are owed at once (so
  that a normal search always has one it may stop), first come, first served, except that the request of
  a client stopped in every run up to the longest gives its place to one stopped fewer times.
  Before, every request that outlived two quanta in a full background was stopped whenever a client with
  nothing under way came, and the stopped clients' retries were such clients: with more clients sending
  costly work than the server runs, legitimate slow work never ended (27 of 28 thumbnails of a costly
  gallery file preempted in bench/hostile_fairness.py).
So costly decodes (a batch of 64 images that each take seconds, uploads that take a decode's whole limit)
from several clients at once hold no slot past their first ``quantum``: before, three hostile addresses held
both slots and a normal search waited 30 s for one (bench/hostile_budget.py before these slots; README).
The cores go to the short requests first and the long ones go on with what is left.

Where the index is on an index server (Milvus: ``within_deadline``), a request waits for a slot no longer
than its deadline (``foundation.deadline``: the API's ``index_deadline_seconds``, counted from when its body
arrived): past it, 503 ``deadline_exceeded``, so that slots held by searches hung on the index server do not
make every request behind them overrun the deadline as well. An index in a folder (FAISS) has no deadline:
a request waits its turn.

A request whose client goes away stops: a decode under way has its process ended (``engine.decode.pool``),
and work not yet started does not start, so the slot is free again at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import ParamSpec, TypeVar

import anyio.to_thread
from starlette.requests import Request

from app.clients import Clients
from engine.decode.pool import DecodeCancelledError, cancelled_by
from foundation import defaults
from foundation.deadline import time_left
from foundation.errors import DmlsearchError, ErrorKind
from foundation.priority import lowered_by

# How often a request whose work is under way checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.2
# How long (in quanta since it took its slot) a request in the background runs at least before it may be
# stopped for a client with nothing under way.
PREEMPT_AFTER_QUANTA = 2
# How long a client whose request was stopped is owed a longer run (its retry: the 503 says Retry-After
# 5 s; a browser retrying a page's thumbnails takes longer), and how many times in a row that run doubles:
# 2 quanta, then 4, 8, 16 and 32 (16 s at the default quantum; a decode's CPU limit is 5 s).
OWED_SECONDS = 60.0
OWED_DOUBLINGS = 4
P = ParamSpec("P")
T = TypeVar("T")


class SlotWaitTimeoutError(DmlsearchError, TimeoutError):
    """The request's deadline passed while it waited for a compute slot."""

    kind = ErrorKind.UNAVAILABLE
    code = "deadline_exceeded"


class SlotPreemptedError(DmlsearchError, RuntimeError):
    """The request was stopped in the background so that a client with nothing under way had a slot."""

    kind = ErrorKind.UNAVAILABLE
    code = "preempted"


def default_slots() -> int:
    """The CPU cores this process may use (a container's CPU set, not the host's core count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_share(slots: int) -> int:
    """The slots one client may hold unless told: half of them (one of two), at least one."""
    return max(1, slots // 2)


class _Hold:
    """One request's hold on a slot: whose, since when, whether it went on in the background (its
    ``lowered`` event lowers its decodes' priority, unless it is ``owed``: the retry of a client stopped
    that many times in a row), and the event that stops its work (a client's request: set when the client
    goes away or the request is preempted; None for the server's own work, never stopped)."""

    def __init__(self, client: str, stop: threading.Event | None) -> None:
        self.client = client
        self.stop = stop
        self.preempted = False
        self.owed = 0
        self.background = False
        self.since = 0.0  # loop time when granted
        self.lowered = threading.Event()
        self.granted: asyncio.Future[None] | None = None  # while waiting

    def stoppable_after(self, quantum: float) -> float:
        """The loop time from which it may be preempted."""
        return self.since + PREEMPT_AFTER_QUANTA * 2 ** min(self.owed, OWED_DOUBLINGS) * quantum


class ComputeSlots:
    """Run blocking CPU work in worker threads, at most ``slots`` at a time in the foreground (and at most
    ``background`` more that gave theirs up after ``quantum`` seconds), at most ``share`` of them for one
    client (as ``clients`` tells them apart). Create and use inside the event loop (the counts need no lock
    there)."""

    def __init__(
        self,
        slots: int,
        share: int = 0,
        clients: Clients | None = None,
        *,
        quantum: float = defaults.COMPUTE_QUANTUM_SECONDS,
        background: int | None = None,
        within_deadline: Callable[[], bool] = lambda: True,
    ) -> None:
        if slots < 1 or share < 0 or quantum <= 0 or (background is not None and background < 0):
            raise ValueError(
                f"compute slots need slots >= 1, share >= 0, quantum > 0 and background >= 0, got {slots}, "
                f"{share}, {quantum} and {background}"
            )
        self.slots = slots
        self.share = min(share or default_share(slots), slots)
        self.quantum = quantum
        self.background = slots if background is None else background
        self.clients = clients or Clients()
        self.within_deadline = within_deadline  # whether waits end at the request's deadline now
        self.held: Counter[str] = Counter()  # slots held (foreground and background), by client
        self._holds: list[_Hold] = []  # granted, oldest first
        self._waiting: list[_Hold] = []  # oldest first
        # Clients whose last request was preempted: when, and how many times in a row; oldest first.
        self._owed: dict[str, tuple[float, int]] = {}
        self._timer: asyncio.TimerHandle | None = None

    @property
    def in_use(self) -> int:
        """Foreground slots held."""
        return sum(not hold.background for hold in self._holds)

    @property
    def in_background(self) -> int:
        return sum(hold.background for hold in self._holds)

    @property
    def most_at_once(self) -> int:
        """The most requests that run at once (each holds a decode process while it decodes)."""
        return self.slots + self.background

    async def run(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, float]:
        """``function(*args, **kwargs)`` in a worker thread once a slot is free, for work no client asked
        for; also the ms spent waiting."""
        return await self._run(_Hold("server", None), partial(function, *args, **kwargs))

    async def run_for(
        self, request: Request, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> tuple[T, float]:
        """:meth:`run` for ``request``, within its client's share: if its client disconnects, the work
        stops (raising :class:`DecodeCancelledError`) instead of holding the slot to its end; if it is
        preempted, :class:`SlotPreemptedError`."""
        stop = threading.Event()
        hold = _Hold(self.clients.key(request.scope), stop)
        watcher = asyncio.create_task(_watch(request, stop))
        try:
            return await self._run(hold, partial(function, *args, **kwargs))
        finally:
            watcher.cancel()

    async def _run(self, hold: _Hold, work: Callable[[], T]) -> tuple[T, float]:
        started = time.perf_counter()
        async with self._slot(hold):
            queued_ms = (time.perf_counter() - started) * 1000.0
            try:
                return await anyio.to_thread.run_sync(_within, hold, work), queued_ms
            except DecodeCancelledError:
                if hold.preempted:
                    raise SlotPreemptedError(
                        "this request was stopped after it had run in the background for a while, to give "
                        "its compute slot to a client with nothing under way (more clients sent costly "
                        "work at once than the server runs): retry later, or send cheaper images"
                    ) from None
                raise

    @asynccontextmanager
    async def _slot(self, hold: _Hold) -> AsyncIterator[None]:
        client = hold.client
        if self._admits(client):  # every waiter that could take a free slot already has one
            self._grant(hold)
        else:
            hold.granted = asyncio.get_running_loop().create_future()
            self._waiting.append(hold)
            self._share_out()  # a hold past its quantum may go to the background for it
            left = time_left() if self.within_deadline() else None
            try:
                async with asyncio.timeout(None if left is None else max(left, 0.0)):
                    await hold.granted
            except BaseException as err:
                if hold.granted.done() and not hold.granted.cancelled():  # granted as it was cancelled
                    self._release(hold)
                else:
                    self._waiting.remove(hold)
                if isinstance(err, TimeoutError):
                    raise SlotWaitTimeoutError(
                        f"the request's deadline passed while it waited for a compute slot "
                        f"({self.in_use} of {self.slots} held): retry later"
                    ) from None
                raise
        try:
            yield
        finally:
            self._release(hold)

    def _admits(self, client: str) -> bool:
        return self.in_use < self.slots and self.held[client] < self.share

    def _grant(self, hold: _Hold) -> None:
        hold.since = asyncio.get_running_loop().time()
        if hold.stop is not None and self._owes(hold.client):
            self._owe(hold, self._owed[hold.client][1])
        self.held[hold.client] += 1
        self._holds.append(hold)
        if hold.granted is not None:
            hold.granted.set_result(None)

    def _owe(self, hold: _Hold, times: int) -> None:
        """``hold`` runs as owed ``times`` stops in a row, within ``background`` owed holds: where they are
        all taken, it takes the place of the one owed the most if that one's client was stopped in every
        run up to the longest (``OWED_DOUBLINGS`` times) and more often than its own (it goes on as any
        other hold). The places are first come, first served, except that work no run lets end gives way."""
        owed = [held for held in self._holds if held.owed]
        if len(owed) >= self.background:
            most = max(owed, key=lambda held: held.owed, default=None)
            if most is None or most.owed < OWED_DOUBLINGS or most.owed <= times:
                return
            most.owed = 0
            if most.background:
                most.lowered.set()
        hold.owed = times

    def _owes(self, client: str) -> bool:
        """Whether ``client`` had a request preempted within ``OWED_SECONDS`` and has not had its retry."""
        now = asyncio.get_running_loop().time()
        while self._owed and next(iter(self._owed.values()))[0] < now - OWED_SECONDS:
            del self._owed[next(iter(self._owed))]  # oldest first: the forgotten ones
        return client in self._owed

    def _release(self, hold: _Hold) -> None:
        if hold.preempted:
            _, times = self._owed.pop(hold.client, (0.0, 0))
            self._owed[hold.client] = (asyncio.get_running_loop().time(), times + 1)
        elif hold.stop is not None:  # it ended unstopped: its client is owed nothing more
            self._owed.pop(hold.client, None)
        self._holds.remove(hold)
        self.held[hold.client] -= 1
        if not self.held[hold.client]:
            del self.held[hold.client]
        self._share_out()

    def _share_out(self) -> None:
        """Free slots to waiters, the client holding the fewest first (the longest waiting among equals);
        where every slot is held and a waiter could take one, the foreground hold longest past its quantum
        goes to the background while there is room there, else, for a waiting client with nothing under
        way and owed nothing, the request whose time is up first is preempted (its release shares out
        again)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while True:
            candidates = [
                hold
                for hold in self._waiting
                if hold.granted is not None
                and not hold.granted.done()  # done: cancelled, on its way out
                and self.held[hold.client] < self.share
            ]
            if not candidates:
                return
            if self.in_use < self.slots:
                chosen = min(candidates, key=lambda hold: self.held[hold.client])  # stable: oldest of equals
                self._waiting.remove(chosen)
                self._grant(chosen)
                continue
            foreground = [hold for hold in self._holds if not hold.background]
            preempt = not (self.in_background < self.background and foreground)
            oldest_or_none = self._preemptible(candidates) if preempt else foreground[0]
            if oldest_or_none is None:
                return
            oldest = oldest_or_none
            loop = asyncio.get_running_loop()
            due = oldest.stoppable_after(self.quantum) if preempt else oldest.since + self.quantum
            if loop.time() < due:
                self._timer = loop.call_at(due, self._share_out)
                return
            if preempt and oldest.stop is not None:
                oldest.preempted = True  # its slot is shared out once its work lets go
                oldest.stop.set()
                return
            oldest.background = True  # its slot is free for the waiter
            if not oldest.owed:
                oldest.lowered.set()

    def _preemptible(self, candidates: list[_Hold]) -> _Hold | None:
        """The request that may be stopped first (the background's before the foreground's at equal
        times, the longest held among equals), to stop for a waiting client with nothing under way and
        owed nothing; None where no client waits so, where one is already being stopped, where there is no
        background (nothing is stopped then), or where none can be."""
        if not self.background or any(hold.preempted for hold in self._holds):
            return None
        if all(self.held[hold.client] or self._owes(hold.client) for hold in candidates):
            return None
        stoppable = [hold for hold in self._holds if hold.stop is not None]
        return min(
            stoppable,
            key=lambda hold: (hold.stoppable_after(self.quantum), not hold.background),
            default=None,
        )


async def _watch(request: Request, gone: threading.Event) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    gone.set()


def _within(hold: _Hold, work: Callable[[], T]) -> T:
    """``work``, stopped once ``hold.stop`` is set, its decodes lowered once ``hold.lowered`` is."""
    if hold.stop is None:
        with lowered_by(hold.lowered):
            return work()
    if hold.stop.is_set():  # it went away while the request waited for its slot
        raise DecodeCancelledError("the client went away")
    with cancelled_by(hold.stop), lowered_by(hold.lowered):
        return work()
