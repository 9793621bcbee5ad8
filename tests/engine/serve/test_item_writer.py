"""engine.serve.item_writer: adds and removes store gallery files and index items together, or neither."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.lib.images import image_bytes, make_image
from engine.decode.images import ImageDecodeError
from engine.model.embedder import Embedder
from engine.serve.item_reader import ItemNotFoundError
from engine.serve.item_writer import DuplicateItemError, InvalidItemError, ItemWriter, NewItem, StorageError
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from foundation.defaults import TRASH_FOLDER
from index.gallery import GalleryIndex
from index.items import ItemStore
from index.protocol import BackendUnavailableError
from index.selection import IndexOptions

IMAGE_SIZE = (40, 36)


@dataclass
class Writable:
    writer: ItemWriter
    current: CurrentBundle
    gallery: Path
    index: Path


def _open(small_model: Path, gallery: Path | None, index: Path) -> Writable:
    embedder = Embedder(small_model, threads=1)
    if not index.exists():
        GalleryIndex.create(
            index,
            dim=embedder.dim,
            model_fingerprint=embedder.fingerprint,
            gallery_root=gallery,
            options=IndexOptions("flat"),
        ).close()
    current = CurrentBundle(LoadedBundle(embedder, GalleryIndex.open(index)))
    return Writable(ItemWriter(current, ServingConfig()), current, gallery or index, index)


@pytest.fixture
def writable(small_model: Path, tmp_path: Path) -> Iterator[Writable]:
    """An empty FAISS index over an empty gallery folder, served with the small model."""
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    opened = _open(small_model, gallery, tmp_path / "index")
    yield opened
    opened.current.bundle.index.close()


def _png(seed: int) -> bytes:
    return image_bytes(make_image(seed, size=IMAGE_SIZE))


def _files(gallery: Path) -> set[Path]:
    return {path.relative_to(gallery) for path in gallery.rglob("*") if path.is_file()}


def test_added_images_are_stored_by_label_and_content_and_indexed_and_saved(writable: Writable) -> None:
    data = [_png(1), _png(2)]
    added = writable.writer.add([NewItem(data[0], "cats"), NewItem(data[1])])
    digests = [hashlib.sha256(d).hexdigest() for d in data]
    assert [(i.path, i.label, i.content_hash) for i in added] == [
        (f"cats/{digests[0][:20]}.png", "cats", digests[0]),
        (f"{digests[1][:20]}.png", None, digests[1]),  # no label: the gallery root
    ]
    assert all(item.taken for item in added)  # no EXIF date: the time the file was added
    assert [(writable.gallery / i.path).read_bytes() for i in added] == data
    assert _files(writable.gallery) == {Path(i.path) for i in added}
    query = writable.current.bundle.embedder.embed([make_image(1, size=IMAGE_SIZE)])
    ((best, *_),) = writable.current.bundle.index.search(query, 1)
    assert best.item.id == added[0].id
    writable.current.bundle.index.close()
    reopened = GalleryIndex.open(writable.index)  # saved before add returned
    try:
        assert [reopened.items.get(i.id) for i in added] == added and reopened.manifest.count == 2
    finally:
        reopened.close()


def test_a_bad_image_leaves_the_gallery_and_the_index_unchanged(writable: Writable) -> None:
    with pytest.raises(ImageDecodeError, match="image 1"):
        writable.writer.add([NewItem(_png(1), "cats"), NewItem(b"not an image", "cats")])
    assert _files(writable.gallery) == set()
    assert len(writable.current.bundle.index) == 0


def test_duplicates_are_refused_and_the_stored_file_is_kept(writable: Writable) -> None:
    with pytest.raises(DuplicateItemError, match="repeats an earlier image"):
        writable.writer.add([NewItem(_png(1), "cats"), NewItem(_png(1), "cats")])
    assert _files(writable.gallery) == set()
    (first,) = writable.writer.add([NewItem(_png(1), "cats")])
    with pytest.raises(DuplicateItemError, match="already indexed"):
        writable.writer.add([NewItem(_png(2), "cats"), NewItem(_png(1), "cats")])
    assert _files(writable.gallery) == {Path(first.path)}  # the new image's file was not left behind
    assert (writable.gallery / first.path).read_bytes() == _png(1)
    # Another label: still one content, so one item.
    with pytest.raises(DuplicateItemError, match=f"as item {first.id}"):
        writable.writer.add([NewItem(_png(1), "dogs")])
    with pytest.raises(DuplicateItemError, match="repeats an earlier image"):
        writable.writer.add([NewItem(_png(3), "dogs"), NewItem(_png(3), "birds")])
    assert len(writable.current.bundle.index) == 1


def test_a_label_in_another_case_is_the_stored_label(writable: Writable) -> None:
    (first,) = writable.writer.add([NewItem(_png(1), "Cats")])
    added = writable.writer.add(
        [NewItem(_png(n), label) for n, label in ((2, "CATS"), (3, "cats"), (4, "cAtS"))]
    )
    assert {item.label for item in added} == {"Cats"}
    assert all(item.path.startswith("Cats/") for item in [first, *added])


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("../outside", "image 0: label '../outside' contains"),
        ("notes.txt", "image 0: label 'notes.txt' names a file"),
        ("index", "image 0: label 'index' names the index's own folder"),
    ],
)
def test_labels_that_are_no_folder_of_their_own_are_refused(
    small_model: Path, tmp_path: Path, label: str, message: str
) -> None:
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    (gallery / "notes.txt").write_text("not a folder of images")
    opened = _open(small_model, gallery, gallery / "index")  # the index inside its gallery folder
    before = _files(gallery)
    try:
        with pytest.raises(InvalidItemError, match=message):
            opened.writer.add([NewItem(_png(1), label)])
        assert _files(gallery) == before and len(opened.current.bundle.index) == 0
    finally:
        opened.current.bundle.index.close()


def test_an_index_without_a_gallery_folder_takes_no_new_images(small_model: Path, tmp_path: Path) -> None:
    opened = _open(small_model, None, tmp_path / "index")
    try:
        with pytest.raises(InvalidItemError, match="no gallery folder"):
            opened.writer.add([NewItem(_png(1))])
    finally:
        opened.current.bundle.index.close()


def _hold_the_write_lock(writable: Writable) -> sqlite3.Connection:
    """Another connection takes items.sqlite's write lock. The served store stops waiting for it after 50 ms
    rather than SQLite's 5 s: these tests are about what a refused write leaves, not how long it waits."""
    writable.current.bundle.index.items.connection.execute("PRAGMA busy_timeout = 50")
    blocker = sqlite3.connect(writable.index / ItemStore.FILE_NAME, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    return blocker


def test_a_failed_index_write_removes_the_files_it_wrote(writable: Writable) -> None:
    """Another connection holds items.sqlite's write lock: the insert fails once SQLite stops waiting."""
    blocker = _hold_the_write_lock(writable)
    try:
        with pytest.raises(StorageError, match="nothing was added"):
            writable.writer.add([NewItem(_png(1), "cats")])
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert _files(writable.gallery) == set() and len(writable.current.bundle.index) == 0
    (added,) = writable.writer.add([NewItem(_png(1), "cats")])  # the lock released: the same add goes in
    assert _files(writable.gallery) == {Path(added.path)}


def test_a_delete_the_index_refuses_puts_the_photo_back(writable: Writable) -> None:
    """Another connection holds items.sqlite's write lock (a read-only index folder fails alike): the
    photo, already set aside, goes back, and the gallery is as it was."""
    (added,) = writable.writer.add([NewItem(_png(1), "cats")])
    before = sorted(writable.gallery.rglob("*"))
    blocker = _hold_the_write_lock(writable)
    try:
        with pytest.raises(StorageError, match=f"item {added.id} was not deleted"):
            writable.writer.remove(added.id)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert sorted(writable.gallery.rglob("*")) == before
    assert writable.current.bundle.index.items.get(added.id) == added


def test_removed_items_leave_the_index_and_their_file_is_set_aside(writable: Writable) -> None:
    kept, gone = writable.writer.add([NewItem(_png(1), "cats"), NewItem(_png(2), "cats")])
    removed = writable.writer.remove(gone.id)
    assert removed.item == gone and removed.set_aside == [gone.path] and removed.plan_id is not None
    index = writable.current.bundle.index
    assert index.items.get(gone.id) is None and len(index) == 1
    assert not (writable.gallery / gone.path).exists()
    assert (writable.gallery / TRASH_FOLDER / removed.plan_id / gone.path).read_bytes() == _png(2)
    with pytest.raises(ItemNotFoundError):
        writable.writer.remove(gone.id)
    index.close()
    reopened = GalleryIndex.open(writable.index)
    try:
        assert reopened.items.get(gone.id) is None and reopened.items.get(kept.id) == kept
        assert reopened.manifest.count == 1
    finally:
        reopened.close()


def test_an_add_the_index_server_stored_but_did_not_confirm_says_so(
    writable: Writable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Milvus's answer to the insert or to the flush after it lost (a call past the request's deadline,
    found by bench/operator_walkthrough.py: an add answered 503 and was stored): the 503 says what
    happened, and no stored item is left without its photo."""
    index = writable.current.bundle.index
    stored, saved = index.add, index.save

    def stored_but_unanswered(*args: object) -> list[int]:
        stored(*args)
        raise BackendUnavailableError("Milvus at http://milvus:19530: no answer to insert within 3.2 s")

    def unconfirmed_save() -> None:
        raise BackendUnavailableError("Milvus at http://milvus:19530: no answer to flush within 0.4 s")

    monkeypatch.setattr(index, "add", stored_but_unanswered)
    with pytest.raises(BackendUnavailableError, match="whether the images were stored is unknown"):
        writable.writer.add([NewItem(_png(1), "cats")])
    monkeypatch.setattr(index, "add", stored)
    (kept,) = index.items.scan()
    assert _files(writable.gallery) == {Path(kept.path)}  # the stored item's photo is kept
    with pytest.raises(DuplicateItemError, match=f"as item {kept.id}"):  # sent again: it was stored
        writable.writer.add([NewItem(_png(1), "cats")])

    monkeypatch.setattr(index, "save", unconfirmed_save)
    with pytest.raises(BackendUnavailableError, match=r"items \[\d+\] were stored and are searchable, but"):
        writable.writer.add([NewItem(_png(2), "cats")])
    monkeypatch.setattr(index, "save", saved)
    assert len(index) == 2 and len(_files(writable.gallery)) == 2
