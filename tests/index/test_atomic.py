"""Atomic writes: all or nothing, no temporary files left, ordinary permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from index.atomic import atomic_path, atomic_write_text


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
