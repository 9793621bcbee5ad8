"""A decoder that runs its tasks in the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CountingDecoder:
    """A ``engine.decode.pool.Decoder`` that runs its tasks here, recording the arguments of each."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, task: Callable[..., Any], *args: Any, images: int = 1, **kwargs: Any) -> Any:
        self.calls.append(args)
        return task(*args, **kwargs)
