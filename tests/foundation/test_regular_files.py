"""foundation.regular_files: a name that holds a FIFO, a device, a socket or a folder is refused at once,
links followed; a file read whole stops at its limit."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from foundation.regular_files import (
    FileTooLargeError,
    NotRegularFileError,
    open_regular,
    read_regular,
    require_regular,
)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _socket(path: Path) -> Path:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))  # the name stays after the socket is closed (and cannot be opened)
    listener.close()
    return path


def _link_to_fifo(path: Path) -> Path:
    path.symlink_to(_fifo(path.with_name("target.fifo")))
    return path


def _device(path: Path) -> Path:
    path.symlink_to("/dev/zero")  # a link to a device: what counts is where it leads
    return path


SPECIAL: dict[str, Callable[[Path], Path]] = {
    "a FIFO": _fifo,
    "a folder": _folder,
    "a socket": _socket,
    "a link to a FIFO": _link_to_fifo,
    "a device": _device,
}


def _within(seconds: float, work: Callable[[], object]) -> BaseException | None:
    """Run ``work`` in a thread; fail if it is still running after ``seconds`` (a FIFO's open waits)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as err:  # handed to the test
            raised.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked on a special file"
    return raised[0] if raised else None


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    path = SPECIAL[kind](tmp_path / "manifest.json")
    for read in (lambda: read_regular(path, 1024), lambda: open_regular(path), lambda: require_regular(path)):
        err = _within(5, read)
        assert isinstance(err, NotRegularFileError), err
        assert "not a regular file" in str(err)


def test_a_regular_file_is_read_up_to_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"x" * 100)
    assert read_regular(path, 100) == b"x" * 100
    with pytest.raises(FileTooLargeError, match="over 99 bytes"):
        read_regular(path, 99)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "absent.json", 100)
