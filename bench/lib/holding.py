"""A task that holds memory the way a long decode does, for benches of what ending its worker costs."""

from __future__ import annotations

import time


def hold(nbytes: int, seconds: float) -> None:
    """Take ``nbytes`` (every page touched) and keep them for ``seconds``."""
    held = bytearray(nbytes)
    held[::4096] = b"x" * len(held[::4096])
    time.sleep(seconds)
