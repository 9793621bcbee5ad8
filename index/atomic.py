"""Crash-safe writes: everything goes to a temporary name in the same directory, then is renamed."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Read once at import (setting and restoring the umask is not thread-safe later on).
_UMASK = os.umask(0)
os.umask(_UMASK)


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it over ``target`` only if the block succeeds.

    The new file gets the old one's permissions (or the umask's, like any new file, rather than
    mkstemp's owner-only 0600, so a server running as another user can read an index built here), and
    it is flushed to disk before the rename, so even a power cut leaves the old or the new file whole.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    temporary_path = Path(temporary)
    try:
        yield temporary_path
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~_UMASK
        os.chmod(temporary_path, mode)
        _fsync(temporary_path)
        os.replace(temporary_path, target)
        _fsync(target.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
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


def atomic_link_or_copy(source: Path, target: Path) -> None:
    """Put the file ``source`` at ``target`` whole or not at all: a hard link where the file system allows
    (no bytes copied; an export replaces its files by renaming, so the link keeps the old bytes), else a copy.

    Unlike :func:`atomic_path` the new name keeps ``source``'s permissions: it may be the same inode.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}.link")
    try:
        os.link(source, temporary)
    except OSError:  # another file system, or one without hard links
        atomic_write_with(target, lambda path: shutil.copyfile(source, path))
        return
    try:
        os.replace(temporary, target)
        _fsync(target.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    finally:
        temporary.unlink(missing_ok=True)
