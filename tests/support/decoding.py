"""A decoder that runs its tasks in the test."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class CountingDecoder:
    """A ``engine.decode.pool.Decoder`` that runs its tasks here, recording the arguments of each."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, task: Callable[..., Any], *args: Any, images: int = 1, **kwargs: Any) -> Any:
        self.calls.append(args)
        return task(*args, **kwargs)


def imported(module: str) -> bool:
    """Whether ``module`` is imported in this process already: a task for a decode worker, to see what it
    starts with (this module imports nothing that a worker does not)."""
    return module in sys.modules
