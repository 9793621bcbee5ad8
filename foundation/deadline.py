"""A request's deadline for the calls it makes to an index server (Milvus), carried in a context variable.

The API opens one for every request (:func:`request_deadline`); the index backend asks how long its next
call may take (:func:`call_budget`). The clock starts once the request's body has arrived (the API starts
it), or at its first such call where nothing started it: an upload has limits of its own, and a slow one
must not leave its search no time; the wait for a compute slot (which ends at the deadline where the index
is on a server: ``app.compute``) and the model run count. Worker threads
see the deadline of the request they run for (``anyio`` copies the context into them); outside a request
(the CLI) each call has the caller's own bound only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


class DeadlinePassedError(TimeoutError):
    """The request's deadline for index-server calls has passed before its next call."""


@dataclass
class Deadline:
    seconds: float
    due: float | None = None  # monotonic time, once started

    def start(self) -> None:
        if self.due is None:
            self.due = time.monotonic() + self.seconds

    def remaining(self) -> float:
        self.start()
        assert self.due is not None
        return self.due - time.monotonic()


_current: ContextVar[Deadline | None] = ContextVar("dmlsearch_request_deadline", default=None)


@contextmanager
def request_deadline(seconds: float) -> Iterator[Deadline | None]:
    """Within this block, index-server calls share ``seconds`` in all (0: no deadline, None yielded),
    counted from :meth:`Deadline.start` or else the first call."""
    deadline = Deadline(seconds) if seconds > 0 else None
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)


def within_deadline() -> bool:
    """Whether calls now share a request's deadline."""
    return _current.get() is not None


def time_left() -> float | None:
    """Seconds left of the current request's deadline (negative once passed; None where there is none)."""
    deadline = _current.get()
    return None if deadline is None else deadline.remaining()


def call_budget(limit: float) -> float:
    """Seconds the next index-server call may take: ``limit``, or less where the request's deadline is
    nearer. Raises :class:`DeadlinePassedError` where nothing is left."""
    deadline = _current.get()
    if deadline is None:
        return limit
    left = deadline.remaining()
    if left <= 0:
        raise DeadlinePassedError(f"the request's deadline of {deadline.seconds:g} s for the index passed")
    return min(limit, left)
