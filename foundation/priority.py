"""The CPU priority of one request's work: lowered once it gives its compute slot up (``app.compute``).

The work of one request runs in threads and processes of its own (its decode process, its model run); each
reads :func:`lowering` where it starts and runs at ``LOWERED_NICENESS`` once the event is set, so that the
cores go to every other request's work first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# The niceness of lowered work: the lowest priority, so that the kernel gives the cores to all other work
# first (a weight of 15 against 1024 for niceness 0).
LOWERED_NICENESS = 19

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
