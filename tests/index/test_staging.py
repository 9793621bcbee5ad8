"""index.staging's own rules, on real index directories: which staging copy a staged write continues."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from index.gallery import GalleryIndex
from index.staging import remove_leftover, staged_write, staging_directory
from tests.support.vectors import entries

FINGERPRINT = "f" * 64


def _create(directory: Path) -> GalleryIndex:
    return GalleryIndex.create(directory, dim=4, model_fingerprint=FINGERPRINT, gallery_root=None)


def _written(target: Path, *, resume: bool = True) -> tuple[Path, bool]:
    """Open a staged write of ``target`` and leave it uncommitted: (its directory, whether it was created)."""
    created = []

    def create(directory: Path) -> GalleryIndex:
        created.append(directory)
        return _create(directory)

    with staged_write(target, fingerprint=FINGERPRINT, create=create, resume=resume) as staged:
        return staged.directory, bool(created)


def test_an_interrupted_staging_copy_is_continued(tmp_path: Path) -> None:
    target = tmp_path / "index"
    directory, created = _written(target)
    assert created and directory == staging_directory(target)
    assert _written(target) == (directory, False)  # the same model's copy: continued, not made again


def test_only_the_old_index_a_killed_swap_left_is_a_leftover(tmp_path: Path) -> None:
    """After the exchange of a swap the staging name holds the old index; a kill before it is removed
    leaves it there. A write that does not stage removes it; a staging copy being written is kept."""
    target = tmp_path / "index"
    _create(target).close()
    _create(tmp_path / "old").close()
    (tmp_path / "old").rename(staging_directory(target))  # what a kill right after the exchange leaves
    remove_leftover(target)
    assert not staging_directory(target).exists()
    directory, _ = _written(target)  # an interrupted staged write
    remove_leftover(target)
    assert directory.exists() and _written(target) == (directory, False)  # kept, and continued


def test_a_committed_index_holds_the_same_files_as_one_written_in_place(tmp_path: Path) -> None:
    target = tmp_path / "index"
    with staged_write(target, fingerprint=FINGERPRINT, create=_create) as staged:
        staged.index.add(np.eye(4, dtype=np.float32), entries(4))
        staged.commit(None)
    in_place = _create(tmp_path / "in-place")
    in_place.add(np.eye(4, dtype=np.float32), entries(4))
    in_place.build()
    in_place.save()
    in_place.close()
    assert sorted(path.name for path in target.iterdir()) == sorted(
        path.name for path in in_place.directory.iterdir()
    )
    assert not staging_directory(target).exists()
