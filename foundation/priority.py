"""The CPU priority of one request's work: lowered once it gives its compute slot up (``app.compute``).

The work of one request runs in threads and processes of its own (its decode process, its model run); each
reads :func:`lowering` where it starts and runs at ``LOWERED_NICENESS`` once the event is set, so that the
cores go to every other request's work first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any, TypeVar

# The niceness of lowered work: the lowest priority, so that the kernel gives the cores to all other work
# first (a weight of 15 against 1024 for niceness 0).
LOWERED_NICENESS = 19

T = TypeVar("T")
_lower: ContextVar[threading.Event | None] = ContextVar("lower", default=None)


@contextmanager
def lowered_by(event: threading.Event) -> Iterator[None]:
    """Work started in this context (this thread) runs at ``LOWERED_NICENESS`` once ``event`` is set, from
    then on."""
    token = _lower.set(event)
    try:
        yield
    finally:
        _lower.reset(token)


def lowering() -> threading.Event | None:
    """The event that lowers work started here (:func:`lowered_by`), if any."""
    return _lower.get()


def run_lowered(work: Callable[[], T]) -> T:
    """``work()`` in a thread of its own at ``LOWERED_NICENESS``. On Linux a thread's niceness is its own
    (``setpriority`` on its native id), and an unprivileged process cannot raise it again: the caller's
    thread (a pooled worker that serves other requests next) stays as it is. ``MemoryError`` where no
    thread can start (no room left to map its stack: the process is at its memory cap)."""
    outcome: list[tuple[bool, Any]] = []

    def lowered() -> None:
        with suppress(OSError):  # not Linux, or the thread gone: it runs as it is
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWERED_NICENESS)
        try:
            outcome.append((True, work()))
        except BaseException as err:  # handed to the caller
            outcome.append((False, err))

    thread = threading.Thread(target=lowered, name="dmlsearch-lowered", daemon=True)
    try:
        thread.start()
    except RuntimeError as err:
        raise MemoryError(f"could not start a lowered thread: {err}") from None
    thread.join()
    done, value = outcome[0]
    if not done:
        raise value
    return value
