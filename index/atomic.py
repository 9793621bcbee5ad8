"""Crash-safe writes: everything goes to a temporary name in the same directory, then is renamed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it over ``target`` only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    temporary_path = Path(temporary)
    try:
        yield temporary_path
        os.replace(temporary_path, target)
    finally:
        temporary_path.unlink(missing_ok=True)


def atomic_write_bytes(target: Path, data: bytes) -> None:
    with atomic_path(target) as temporary:
        temporary.write_bytes(data)


def atomic_write_text(target: Path, text: str) -> None:
    atomic_write_bytes(target, text.encode())


def atomic_write_with(target: Path, writer: Callable[[Path], object]) -> None:
    """Call ``writer(temporary_path)`` and move the result into place."""
    with atomic_path(target) as temporary:
        writer(temporary)
