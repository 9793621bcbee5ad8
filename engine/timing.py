"""Wall-clock time per named stage of one request (the ``timings_ms`` of a search's answer)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageTimer:
    """Wall-clock milliseconds per named stage of one request."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.ms: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1000.0

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0
