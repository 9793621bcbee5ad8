"""Debounced, batched file changes from watchdog: which paths of a folder changed and have settled.

A path is ready once no event has touched it for ``settle`` seconds and its size and modification time did
not change across that interval (a file still being copied is not ready); everything ready is handed out
as one batch, so a burst of 1,000 copies becomes a few batches. Kept free of the model and index imports,
so that the CLI can read its defaults cheaply.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler

DEFAULT_SETTLE_SECONDS = 1.0
# Files per applied batch: bounds the work (and the time) between two saves of the index.
DEFAULT_MAX_BATCH = 512
# A batch waits for a burst to end, but not longer than this many settle intervals.
MAX_WAIT_SETTLES = 10
# Events that change nothing on disk.
_READ_EVENTS = frozenset({"opened", "closed_no_write"})

FileStamp = tuple[int, int] | None  # (size, mtime_ns); None when nothing is there


def _stamp(path: Path) -> FileStamp:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


@dataclass
class _Pending:
    since: float  # when the path's stamp was last seen to change
    stamp: FileStamp


class ChangeBatcher(FileSystemEventHandler):
    """Collects changed paths from watchdog and hands them out in settled batches (thread-safe)."""

    def __init__(
        self,
        *,
        settle: float = DEFAULT_SETTLE_SECONDS,
        max_batch: int = DEFAULT_MAX_BATCH,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if settle <= 0 or max_batch < 1:
            raise ValueError(f"settle must be > 0 and max_batch >= 1, got {settle} and {max_batch}")
        self.settle = settle
        self.max_batch = max_batch
        self._clock = clock
        self._pending: dict[Path, _Pending] = {}
        self._first_ready: float | None = None  # when the oldest ready path became ready
        self._condition = threading.Condition()

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in _READ_EVENTS:
            return
        if event.is_directory and event.event_type == "modified":
            # A folder is "modified" whenever an entry in it changes, and each entry has events of its
            # own: queueing the folder would make the watcher read every file below it again.
            return
        paths = [event.src_path, getattr(event, "dest_path", "")]
        now = self._clock()
        with self._condition:
            for path in filter(None, paths):
                path = Path(os.fsdecode(path))
                self._pending[path] = _Pending(now, _stamp(path))
            self._condition.notify_all()

    def _ready(self, now: float) -> tuple[list[Path], bool]:
        """The settled paths (their stamps re-checked), and whether unsettled ones remain."""
        ready, waiting = [], False
        for path, pending in self._pending.items():
            if now - pending.since < self.settle:
                waiting = True
                continue
            stamp = _stamp(path)
            if stamp != pending.stamp:  # changed without an event reaching us yet: wait again
                self._pending[path] = _Pending(now, stamp)
                waiting = True
            else:
                ready.append(path)
        return ready, waiting

    def next_batch(self, stop: threading.Event, timeout: float | None = None) -> list[Path]:
        """Block until a batch is due (or ``stop`` is set, or ``timeout`` seconds passed: then an empty
        list); the batch's paths, sorted.

        A batch is due when its paths settled and either no other change is still settling, ``max_batch``
        paths are ready, or the oldest ready path has waited ``MAX_WAIT_SETTLES`` settle intervals.
        """
        tick = self.settle / 4
        deadline = None if timeout is None else self._clock() + timeout
        with self._condition:
            while not stop.is_set() and (deadline is None or self._clock() < deadline):
                now = self._clock()
                ready, waiting = self._ready(now)
                if ready and self._first_ready is None:
                    self._first_ready = now
                overdue = (
                    self._first_ready is not None
                    and now - self._first_ready >= MAX_WAIT_SETTLES * self.settle
                )
                if ready and (not waiting or len(ready) >= self.max_batch or overdue):
                    batch = sorted(ready)[: self.max_batch]
                    for path in batch:
                        del self._pending[path]
                    self._first_ready = now if len(ready) > len(batch) else None
                    return batch
                self._condition.wait(tick)
        return []
