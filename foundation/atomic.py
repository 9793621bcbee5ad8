"""Crash-safe writes: everything goes to a temporary name in the same directory, then is renamed.

A writer holds an exclusive ``flock`` on its temporary file until the rename, so the temporary files of
writers that were killed (``kill -9``, a power cut) can be told from those of live writers, in this
process or another, and removed: :func:`remove_abandoned`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("dmlsearch.index")
# mkstemp's names as atomic_path asks for them: ".<target name>.<8 random characters>.tmp".
_TEMPORARY_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")

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
    temporary_path = Path(temporary)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)  # held until the rename: this file is not abandoned
        yield temporary_path
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~_UMASK
        os.chmod(temporary_path, mode)
        _fsync(temporary_path)
        os.replace(temporary_path, target)
        _fsync(target.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    finally:
        temporary_path.unlink(missing_ok=True)
        os.close(handle)


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


def remove_abandoned(directory: Path) -> list[Path]:
    """Delete the temporary files that interrupted atomic writes left in ``directory``; returns them.

    A temporary file whose lock can be taken has no live writer. Files that cannot be removed (a
    read-only directory) are logged and left.
    """
    try:
        candidates = [
            Path(entry.path) for entry in os.scandir(directory) if _TEMPORARY_NAME.match(entry.name)
        ]
    except OSError:  # no such directory, or unreadable: nothing of ours to clean
        return []
    removed = []
    for path in candidates:
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile (its writer finished), or a link
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
            removed.append(path)
        except BlockingIOError:
            continue  # a live writer's
        except OSError as err:
            log.warning("could not remove %s, left by an interrupted write: %s", path, err)
        finally:
            os.close(descriptor)
    if removed:
        log.warning(
            "removed %d temporary file(s) left by interrupted writes in %s: %s",
            len(removed),
            directory,
            ", ".join(path.name for path in removed),
        )
    return removed
