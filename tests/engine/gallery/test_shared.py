"""The gallery folder shared by the writers of one index (``engine.gallery.shared``), on Milvus Lite and
FAISS: what the replica tests (tests/app/test_milvus_replicas.py) check on the real server, case by case."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from engine.gallery.shared import (
    GalleryNotSharedError,
    folder_mark,
    mark_built_gallery,
    require_shared_gallery,
)
from foundation.defaults import GALLERY_MARK
from foundation.families import Backend
from index.gallery import GalleryIndex

DIM = 8


def _index(directory: Path, gallery: Path, backend: Backend) -> GalleryIndex:
    return GalleryIndex.create(
        directory, dim=DIM, model_fingerprint="f" * 64, gallery_root=gallery, backend=backend
    )


def test_a_folder_is_marked_once_whoever_marks_it(tmp_path: Path) -> None:
    assert folder_mark(tmp_path, create=False) is None
    marks: list[str | None] = []
    threads = [
        threading.Thread(target=lambda: marks.append(folder_mark(tmp_path, create=True))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(marks)) == 1 and marks[0] is not None
    assert (tmp_path / GALLERY_MARK).read_text().strip() == marks[0] == folder_mark(tmp_path, create=False)


def test_writers_of_a_shared_index_must_see_its_folder(tmp_path: Path) -> None:
    pytest.importorskip("milvus_lite")
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.mkdir()
    other.mkdir()
    index = _index(tmp_path / "index", shared, Backend.MILVUS)
    try:
        assert index.gallery_mark() is None  # a collection from before marks
        require_shared_gallery(index)  # takes the folder's mark, marking the folder first
        assert index.gallery_mark() == folder_mark(shared, create=False) is not None
        require_shared_gallery(index)

        with pytest.raises(GalleryNotSharedError, match="another mark"):  # a build from another folder
            mark_built_gallery(index, _marked(other), replace=False)
        index.set_gallery_root(other)  # a replica whose folder is another one
        with pytest.raises(GalleryNotSharedError, match="not the one"):
            require_shared_gallery(index)
        mark_built_gallery(index, other, replace=True)  # repointed on purpose
        require_shared_gallery(index)

        (other / GALLERY_MARK).unlink()  # the share gone from its mount point
        with pytest.raises(GalleryNotSharedError, match=f"has no {GALLERY_MARK}"):
            require_shared_gallery(index)
    finally:
        index.close()


def test_an_index_that_lives_in_its_folder_shares_nothing(tmp_path: Path) -> None:
    index = _index(tmp_path / "index", tmp_path, Backend.FAISS)
    try:
        require_shared_gallery(index)
        mark_built_gallery(index, tmp_path, replace=False)
        assert index.gallery_mark() is None and not (tmp_path / GALLERY_MARK).exists()
    finally:
        index.close()


def _marked(folder: Path) -> Path:
    folder_mark(folder, create=True)
    return folder


def test_a_folder_marked_while_another_process_writes_its_mark_gets_that_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The moment between a mark file's creation and its content: a second marker there took it for no mark
    (an empty file), where it must find the one mark."""
    real_write = os.write
    second: list[str | None] = []

    def write_with_a_second_marker_first(descriptor: int, data: bytes) -> int:
        if not second:  # the first marker's write: another marks the folder before it lands
            second.append(None)

            def mark() -> None:
                second[0] = folder_mark(tmp_path, create=True)

            thread = threading.Thread(target=mark)
            thread.start()
            thread.join()
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", write_with_a_second_marker_first)
    first = folder_mark(tmp_path, create=True)
    monkeypatch.undo()
    assert second[0] is not None and second[0] == first == folder_mark(tmp_path, create=False)
