"""Atomic writes: all or nothing, no temporary files left, ordinary permissions."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from foundation.atomic import atomic_path, atomic_write_text, remove_abandoned


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as temporary:
        temporary.write_text("half of the new")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_new_files_follow_the_umask_and_replacements_keep_their_mode(tmp_path: Path) -> None:
    target = tmp_path / "vectors.faiss"
    atomic_write_text(target, "v1")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # not mkstemp's owner-only 0600
    target.chmod(0o640)
    atomic_write_text(target, "v2")
    assert target.read_text() == "v2"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_abandoned_temporary_files_are_removed_and_live_ones_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    abandoned = tmp_path / ".vectors.faiss.abcd1234.tmp"  # a killed writer's: nobody holds its lock
    abandoned.write_bytes(b"half a file")
    unrelated = tmp_path / ".notes.tmp"  # not a name atomic_path makes
    unrelated.write_text("mine")
    target = tmp_path / "manifest.json"
    with atomic_path(target) as live:
        live.write_text("{}")
        with caplog.at_level(logging.WARNING, logger="dmlsearch.index"):
            assert remove_abandoned(tmp_path) == [abandoned]
        assert live.exists(), "a live writer's temporary file was removed"
    assert target.read_text() == "{}"
    assert unrelated.exists()
    assert "left by interrupted writes" in caplog.text and abandoned.name in caplog.text
    assert remove_abandoned(tmp_path / "missing") == []
