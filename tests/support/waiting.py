"""Polling until a condition holds, failing with what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.05,
    details: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` (and ``details()``, e.g. a process's log)
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what}" + (f":\n{details()}" if details else "")
            )
        time.sleep(interval)
