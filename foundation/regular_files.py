"""Opening the files we read by path (an index's manifest, a model and its card, a duplicates plan, a
gallery image, a query image), whatever their name claims: only regular files, and small ones whole.

A name can hold a FIFO (whose open and read wait for a writer that may never come), a device
(``/dev/zero`` never ends), a socket or a folder. Each is refused at once, before any byte is read:
:func:`open_regular` opens without blocking (``O_NONBLOCK``: a FIFO opens at once) and asks the open
descriptor what it is, so a name swapped between a check and the open cannot slip through. Libraries that
open files themselves (SQLite, onnxruntime, FAISS) get the name only after :func:`require_regular`.
Links are followed: what counts is the file they lead to.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

from foundation import defaults
from foundation.errors import InvalidInputError
from foundation.names import readable_name


class NotRegularFileError(InvalidInputError):
    """A path we were to read is a FIFO, a device, a socket or a folder."""

    code = "not_a_regular_file"


class FileTooLargeError(InvalidInputError):
    """A file read whole is over its size limit (``foundation.defaults``)."""

    code = "file_too_large"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse(path: Path, mode: int) -> NotRegularFileError:
    return NotRegularFileError(f"{readable_name(str(path))} is {_kind(mode)}, not a regular file: refused")


def require_regular(path: Path) -> os.stat_result:
    """``path``'s status when it is a regular file (links followed); else :class:`NotRegularFileError`.
    ``FileNotFoundError`` when there is none."""
    status = os.stat(path)
    if not stat.S_ISREG(status.st_mode):
        raise _refuse(path, status.st_mode)
    return status


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (links followed); False for anything else or nothing."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def open_regular(path: Path) -> io.BufferedReader:
    """``path`` opened for reading in binary when it is a regular file; else :class:`NotRegularFileError`
    without waiting (``FileNotFoundError`` when there is none)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a socket (or a FIFO-like special file with no other end)
            raise _refuse(path, os.stat(path).st_mode) from None
        raise
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular(path: Path, limit: int) -> bytes:
    """The whole of the regular file ``path``, at most ``limit`` bytes; :class:`FileTooLargeError` past it
    (checked as it is read too: a file growing meanwhile is not read on without end)."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        over = size > limit  # refused unread, not read to be refused
        # Sized to the file: a read of ``limit + 1`` reserves that much address space first (512 MiB for
        # an image, over a decode process's whole memory limit), whatever the file's size.
        data = b"" if over else handle.read(size + 1)
        if len(data) > size:  # it grew meanwhile: read on, up to the limit
            data += handle.read(limit + 1 - len(data))
    if over or len(data) > limit:
        raise FileTooLargeError(
            f"{readable_name(str(path))} is over {limit} bytes: not the file expected there"
        )
    return data


def read_image_file(path: Path) -> bytes:
    """An image file read whole (a gallery image, a query named on the command line): a regular file of
    at most ``defaults.IMAGE_FILE_BYTES``."""
    return read_regular(path, defaults.IMAGE_FILE_BYTES)
