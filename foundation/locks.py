"""A readers-writer lock: searches share the index, writes (add/remove) get it alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ReadWriteLock:
    """Many concurrent readers or one writer; writer-preferring.

    Why: a FAISS index must not be searched while it is being modified, but searches are safe to run
    side by side, so serialising them behind one mutex would throw away the server's concurrency.
    A waiting writer blocks new readers so that a steady stream of searches cannot starve it.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writer_active = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._writer_active and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                if self._readers == 0:
                    self._condition.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._condition:
            self._writers_waiting += 1
            try:
                self._condition.wait_for(lambda: not self._writer_active and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer_active = True
        try:
            yield
        finally:
            with self._condition:
                self._writer_active = False
                self._condition.notify_all()
