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

    def include(self, ms: dict[str, float], *, within: str) -> None:
        """Stage times measured inside stage ``within`` (by a decode process), under their own names; each
        is taken off ``within``, which keeps the rest (its own stage of that name, the hop there and back)."""
        for name, spent in ms.items():
            if name != within:
                self.ms[within] -= spent
                self.ms[name] = self.ms.get(name, 0.0) + spent

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0
