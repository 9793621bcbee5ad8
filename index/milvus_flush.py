"""Flushes of the Milvus collections written to between saves (the judgments, ``<collection>_removed``),
made soon after their writes by a thread of their own.

Why: a restarted Milvus 2.3.5 answers reads of a collection written to since its last flush only once it
has replayed those writes, about 25-30 s after it answers at all, at every consistency level (``Session``
and ``Strong`` reads wait; ``Eventually`` ones see none of those rows meanwhile), where a request has 10 s;
a flushed collection answers ``Session`` and ``Eventually`` reads within 1.3-3.7 s (``Strong`` ones wait
~27-29 s, flushed or not; ``python bench/milvus_restart_reads.py``, bench/results/milvus_restart_reads.md,
and the probe it was made from, at load averages 2-6 and 16-20). The items' collection is flushed at every
save (the API saves after each add and delete); judgments arrive one request at a time and were never
saved, and a replica that took any waited ~28 s after a restart (bench/operator_walkthrough.py, issue 42).

A flush of new rows costs about 3 s however few they are (the same bench), so no request waits for one
here, not even at the index's save (flushing ``_removed`` there made each DELETE of
bench/operator_walkthrough.py take ~3.5 s instead of ~1 s): a collection written to is flushed by the
thread once :data:`GATHER_S` has passed, one flush at a time, and a flush covers every write made before it
began (a burst of judgments costs one or two flushes, not one each). A process flushes what is still
pending when it closes the index.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from index.protocol import BackendUnavailableError

GATHER_S = 0.5  # writes gathered into one flush: a burst of judgments, a delete's records
RETRY_S = 2.0  # between tries while the server does not answer

log = logging.getLogger(__name__)


class DeferredFlushes:
    """Flushes the collections :meth:`written` names, in a thread of its own on a connection of its own
    (``background`` opens it: a flush that times out closes that one, not the one requests share)."""

    def __init__(self, server: Any, background: Callable[[], Any]) -> None:
        self.server = server
        self._open_background = background
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    def written(self, collection: str) -> None:
        """``collection`` has rows not flushed yet: flush it soon."""
        with self._lock:
            if self._closed:
                return
            self._pending.add(collection)
            if self._thread is None:
                self._thread = threading.Thread(target=self._flush_forever, name="milvus-flush", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def close(self) -> None:
        """Stop the thread; flush what is still pending, if the server answers (a closing process's last
        judgments or removals)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            names = sorted(self._pending)
            self._pending.clear()
        if names:
            try:
                self._flush_side_by_side(self.server, names)
            except BackendUnavailableError as err:
                log.warning("not flushed at close (written, and flushed by the server later): %s", err)

    @staticmethod
    def _flush_side_by_side(server: Any, names: list[str]) -> None:
        if len(names) <= 1:
            for name in names:
                server.flush(name)
            return
        with ThreadPoolExecutor(len(names), thread_name_prefix="milvus-flush-now") as pool:
            # Each in the caller's context: its request's deadline bounds the flush (foundation.deadline).
            futures = [pool.submit(contextvars.copy_context().run, server.flush, name) for name in names]
            for future in futures:
                future.result()

    def _flush_forever(self) -> None:
        server = None
        while True:
            with self._lock:
                while not self._closed and not self._pending:
                    self._wake.wait()
                if self._closed:
                    break
            time.sleep(GATHER_S)
            with self._lock:
                names = sorted(self._pending)
                self._pending.clear()
            try:
                server = server or self._open_background()
                self._flush_side_by_side(server, names)
            except BackendUnavailableError as err:
                log.info("not flushed yet, tried again in %g s: %s", RETRY_S, err)
                with self._lock:
                    self._pending.update(names)
                    self._wake.wait(RETRY_S)
        if server is not None:
            server.close()
