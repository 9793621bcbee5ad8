"""build-index over image folders: incremental re-runs, resuming, duplicates, model changes, shards."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from bench.lib.images import make_image
from engine.build.embedding import BatchCommitter
from engine.build.indexing import GalleryMismatchError, add_images, build_index
from engine.build.report import BuildReport, MovedFile
from engine.model.embedder import Embedder
from index.connection import MilvusConnection
from index.gallery import GalleryIndex
from index.judgments import JudgedQuery
from index.manifest import Manifest
from index.protocol import Entry
from index.selection import IndexChanges
from index.sharding import Shard
from index.staging import staging_directory


@pytest.fixture
def gallery(tmp_path: Path) -> Path:
    root = tmp_path / "gallery"
    for label_index, label in enumerate(["alpha", "beta", "gamma"]):
        (root / label).mkdir(parents=True)
        for i in range(3):
            make_image(100 * label_index + i, size=(64, 56)).save(root / label / f"{label}_{i}.png")
    return root


def _items(index_dir: Path) -> dict[str, tuple[int, str]]:
    index = GalleryIndex.open(index_dir)
    items = {item.path: (item.id, item.content_hash) for item in index.items.scan()}
    index.close()
    return items


def test_a_copy_outside_the_label_folders_does_not_take_the_labelled_photos_place(
    embedder: Embedder, gallery: Path, tmp_path: Path
) -> None:
    # "IMG_3 copy.jpg" beside the folders sorts before "alpha/…": the labelled photo is still the one indexed.
    shutil.copy(gallery / "beta" / "beta_1.png", gallery / "beta_1 copy.png")
    out = tmp_path / "index"
    report = build_index(gallery, embedder, out, progress=False)
    assert report.duplicates == [("beta_1 copy.png", "beta/beta_1.png")]
    items = _items(out)
    assert "beta/beta_1.png" in items and "beta_1 copy.png" not in items
    ids_in_path_order = [items[path][0] for path in sorted(items)]
    assert ids_in_path_order == sorted(ids_in_path_order)


def test_rerunning_embeds_only_new_or_changed_files(
    embedder: Embedder, gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    first = build_index(gallery, embedder, out, progress=False)
    assert (first.indexed, first.unchanged, first.removed) == (9, 0, 0)
    before = _items(out)

    again = build_index(gallery, embedder, out, progress=False)
    assert (again.indexed, again.unchanged, again.removed, again.rebuilt) == (0, 9, 0, False)
    assert _items(out) == before

    make_image(999, size=(64, 56)).save(gallery / "alpha" / "alpha_0.png")  # changed content
    (gallery / "beta" / "beta_1.png").unlink()  # gone
    make_image(555, size=(64, 56)).save(gallery / "gamma" / "new.png")  # new
    shutil.copy(gallery / "gamma" / "gamma_2.png", gallery / "alpha" / "copy_of_gamma.png")  # duplicate
    changed = build_index(gallery, embedder, out, progress=False)
    assert (changed.indexed, changed.unchanged, changed.removed) == (2, 7, 2)
    assert changed.duplicates == [("alpha/copy_of_gamma.png", "gamma/gamma_2.png")]
    after = _items(out)
    assert set(after) == set(before) - {"beta/beta_1.png"} | {"gamma/new.png"}
    assert after["alpha/alpha_0.png"][0] > max(i for i, _ in before.values())  # new content, new id
    assert all(after[p] == before[p] for p in after if p in before and p != "alpha/alpha_0.png")
    assert Manifest.load(out).count == 9


def test_a_renamed_or_moved_file_keeps_its_item_id_and_is_not_embedded_again(
    embedder: Embedder, gallery: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "index"
    build_index(gallery, embedder, out, progress=False)
    before = _items(out)
    (gallery / "alpha" / "alpha_0.png").rename(gallery / "alpha" / "renamed.png")
    (gallery / "delta").mkdir()
    (gallery / "beta" / "beta_1.png").rename(gallery / "delta" / "moved.png")
    embedded: list[int] = []
    real_embed = Embedder.embed
    monkeypatch.setattr(
        Embedder, "embed", lambda self, images: embedded.append(len(images)) or real_embed(self, images)
    )

    report = build_index(gallery, embedder, out, progress=False)
    assert (report.indexed, report.moved, report.removed, embedded) == (0, 2, 0, [])
    assert report.moves == [  # what build-index prints: each move, and the label the move changed
        MovedFile("alpha/alpha_0.png", "alpha/renamed.png", "alpha", "alpha"),
        MovedFile("beta/beta_1.png", "delta/moved.png", "beta", "delta"),
    ]
    after = _items(out)
    assert after["alpha/renamed.png"] == before["alpha/alpha_0.png"]
    assert after["delta/moved.png"] == before["beta/beta_1.png"]
    index = GalleryIndex.open(out)
    moved = index.items.get_by_path("delta/moved.png")
    assert moved is not None and moved.label == "delta"  # the new folder is its label
    # Its stored vector still finds it first.
    ((hit, *_),) = index.search(index.items.vectors(np.array([moved.id])), 3)
    index.close()
    assert hit.item.id == moved.id and hit.item.path == "delta/moved.png"


def test_linked_folders_are_followed_and_what_they_lead_outside_the_gallery_is_listed(
    embedder: Embedder, gallery: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere" / "delta"
    elsewhere.mkdir(parents=True)
    make_image(400, size=(64, 56)).save(elsewhere / "delta_0.png")
    (gallery / "delta").symlink_to(elsewhere, target_is_directory=True)  # leads outside
    (gallery / "_alpha").symlink_to(gallery / "alpha", target_is_directory=True)  # leads inside
    (gallery / "beta" / "up").symlink_to(gallery, target_is_directory=True)  # a loop
    report = build_index(gallery, embedder, tmp_path / "index", progress=False)
    # The server would refuse to show a file outside the gallery: it is listed, not indexed.
    assert report.skipped == [
        ("delta/delta_0.png", f"links outside the gallery folder (to {elsewhere / 'delta_0.png'})")
    ]
    # A folder linked from inside holds nothing new: its files keep their own paths (and labels), though
    # the link sorts before them.
    assert report.indexed == 9 and not report.duplicates
    assert sorted(_items(tmp_path / "index"))[:3] == [f"alpha/alpha_{i}.png" for i in range(3)]


def _die_during_the_third_batch(monkeypatch: pytest.MonkeyPatch) -> Callable[..., object]:
    """Make the embedder raise KeyboardInterrupt (the process killed) during its third batch; returns the
    real ``embed_tensor`` to put back."""
    calls = {"n": 0}
    real_embed = Embedder.embed_tensor

    def embed_then_die(self: Embedder, batch: np.ndarray) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_embed(self, batch)

    monkeypatch.setattr(Embedder, "embed_tensor", embed_then_die)
    return real_embed


def test_an_interrupted_build_resumes_where_it_stopped(
    embedder: Embedder, gallery: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "index"
    real_embed = _die_during_the_third_batch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build_index(gallery, embedder, out, batch_size=2, progress=False)
    monkeypatch.setattr(Embedder, "embed_tensor", real_embed)
    assert not out.exists()  # no index without its model and search structure at the target
    assert len(_items(staging_directory(out))) == 4  # two batches were committed, aside

    resumed = build_index(gallery, embedder, out, batch_size=2, progress=False)
    assert (resumed.indexed, resumed.unchanged) == (5, 4)
    fresh = tmp_path / "fresh"
    build_index(gallery, embedder, fresh, progress=False)
    assert _items(out) == _items(fresh)  # same ids as an uninterrupted build


def test_an_interrupted_milvus_build_holds_its_model_and_resumes(
    embedder: Embedder, gallery: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new Milvus index is filled in place (its vectors live in the server): killed, it is an index with
    fewer items and its model, never items without the model that embedded them."""
    pytest.importorskip("milvus_lite")
    out = tmp_path / "index"
    milvus = {"backend": "milvus", "milvus": MilvusConnection(str(tmp_path / "milvus.db"))}
    real_embed = _die_during_the_third_batch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build_index(gallery, embedder, out, batch_size=2, progress=False, **milvus)
    monkeypatch.setattr(Embedder, "embed_tensor", real_embed)
    manifest = Manifest.load(out)
    assert manifest.model_file and (out / manifest.model_file).exists()
    resumed = build_index(gallery, embedder, out, batch_size=2, progress=False, **milvus)
    assert resumed.indexed + resumed.unchanged == len(_items(out)) == 9


def test_batches_are_committed_in_order_off_the_calling_thread_and_their_errors_surface() -> None:
    class Sink:
        def __init__(self) -> None:
            self.batches: list[list[str]] = []
            self.threads: set[int] = set()

        def add(
            self,
            vectors: np.ndarray,
            entries: Sequence[Entry],
            signatures: Sequence[bytes],
        ) -> object:
            self.threads.add(threading.get_ident())
            if entries[0].path == "bad":
                raise OSError("disk full")
            self.batches.append([entry.path for entry in entries])
            return None

    def batch(*paths: str) -> tuple[np.ndarray, list[Entry], list[bytes]]:
        vectors = np.ones((len(paths), 4), dtype=np.float32)
        return vectors, [Entry(path, None, "h") for path in paths], [b"s"] * len(paths)

    sink, report = Sink(), BuildReport()
    with BatchCommitter(sink, report) as committer:
        committer.add(*batch("a", "b"))
        committer.add(*batch("c"))
    assert sink.batches == [["a", "b"], ["c"]] and report.indexed == 3
    assert threading.get_ident() not in sink.threads

    sink, report = Sink(), BuildReport()
    with pytest.raises(OSError, match="disk full"), BatchCommitter(sink, report) as committer:
        committer.add(*batch("a"))
        committer.add(*batch("bad"))
        committer.add(*batch("c"))  # waits for "bad": its error is raised here, "c" is never committed
    assert sink.batches == [["a"]] and report.indexed == 1


def test_a_different_model_re_embeds_the_items_under_their_ids_aside_and_swaps(
    embedder: Embedder, small_model: Path, gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    old_model = Embedder(small_model, threads=1)
    build_index(gallery, old_model, out, progress=False)
    before = _items(out)
    (gallery / "gamma" / "gamma_2.png").unlink()
    make_image(900, size=(64, 56)).save(gallery / "gamma" / "new.png")
    (gallery / "delta").mkdir()
    (gallery / "beta" / "beta_0.png").rename(gallery / "delta" / "moved.png")

    report = build_index(gallery, embedder, out, progress=False)
    assert (report.previous_model, report.reembedded, report.indexed) == (old_model.fingerprint, 8, 1)
    assert report.moves == [MovedFile("beta/beta_0.png", "delta/moved.png", "beta", "delta")]
    after = _items(out)
    kept = set(before) - {"gamma/gamma_2.png", "beta/beta_0.png"}
    assert {path: after[path][0] for path in kept} == {path: before[path][0] for path in kept}  # same ids
    assert after["delta/moved.png"][0] == before["beta/beta_0.png"][0]
    assert after["gamma/new.png"][0] > max(item_id for item_id, _ in before.values())
    assert set(after) == kept | {"gamma/new.png", "delta/moved.png"}
    index = GalleryIndex.open(out)
    assert index.items.get_by_path("delta/moved.png").label == "delta"
    index.close()
    assert Manifest.load(out).model_fingerprint == embedder.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gallery", "index"]


def test_an_index_of_another_folder_is_not_taken_over_unless_asked(
    embedder: Embedder, gallery: Path, tmp_path: Path
) -> None:
    """The demo's build into a user's index emptied it: 'indexed 0 images (0 unchanged, 46 removed)'."""
    out = tmp_path / "index"
    build_index(gallery, embedder, out, progress=False)
    before, manifest = _items(out), (out / "manifest.json").read_bytes()
    other = tmp_path / "demo"
    (other / "alpha").mkdir(parents=True)
    shutil.copy(gallery / "alpha" / "alpha_0.png", other / "alpha" / "alpha_0.png")
    make_image(700, size=(64, 56)).save(other / "x.png")

    with pytest.raises(GalleryMismatchError) as refused:
        build_index(other, embedder, out, progress=False)
    message = str(refused.value)
    assert f"indexes the folder {gallery.resolve()}, not {other.resolve()}" in message
    assert "8 of its 9 items are not at the same paths" in message  # alpha/alpha_0.png is there too
    assert "--replace" in message
    assert (_items(out), (out / "manifest.json").read_bytes()) == (before, manifest)

    # The same folder through a link is the same folder.
    (tmp_path / "link").symlink_to(gallery, target_is_directory=True)
    assert build_index(tmp_path / "link", embedder, out, progress=False).unchanged == 9

    report = build_index(other, embedder, out, replace=True, progress=False)
    assert (report.unchanged, report.indexed, report.removed) == (1, 1, 8)
    assert Manifest.load(out).gallery_root == str(other.resolve())
    assert _items(out)["alpha/alpha_0.png"] == before["alpha/alpha_0.png"]


def test_refuses_to_overwrite_a_folder_that_is_not_an_index(
    embedder: Embedder, gallery: Path, tmp_path: Path
) -> None:
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an index directory"):
        build_index(gallery, embedder, precious, progress=False)
    assert (precious / "todo.txt").read_text() == "keep me"


def test_undecodable_gallery_leaves_nothing_behind(embedder: Embedder, tmp_path: Path) -> None:
    root = tmp_path / "broken"
    root.mkdir()
    (root / "a.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="could be decoded"):
        build_index(root, embedder, tmp_path / "index", progress=False)
    assert not (tmp_path / "index").exists()


def test_options_change_rebuilds_from_stored_vectors(
    embedder: Embedder, gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    build_index(gallery, embedder, out, progress=False)
    changes = IndexChanges(index_type="hnsw", target_recall=0.9)
    report = build_index(gallery, embedder, out, progress=False, changes=changes)
    assert (report.indexed, report.rebuilt) == (0, True)  # no image embedded again
    manifest = Manifest.load(out)
    assert (manifest.built.index_type, manifest.requested.index_type, manifest.requested.target_recall) == (
        "hnsw",
        "hnsw",
        0.9,
    )
    assert build_index(gallery, embedder, out, progress=False).rebuilt is False  # options are remembered
    assert Manifest.load(out).built.index_type == "hnsw"


def test_a_memory_budget_can_be_lifted_again(embedder: Embedder, gallery: Path, tmp_path: Path) -> None:
    out = tmp_path / "index"
    build_index(gallery, embedder, out, progress=False, changes=IndexChanges(memory_budget=1 << 30))
    assert Manifest.load(out).requested.memory_budget == 1 << 30
    build_index(gallery, embedder, out, progress=False, changes=IndexChanges(target_recall=0.9))
    assert Manifest.load(out).requested.memory_budget == 1 << 30  # an option not named is kept
    build_index(gallery, embedder, out, progress=False, changes=IndexChanges(memory_budget=None))
    assert (Manifest.load(out).requested.memory_budget, Manifest.load(out).requested.target_recall) == (
        None,
        0.9,
    )


def test_index_add_embeds_files_inside_the_gallery(embedder: Embedder, gallery: Path, tmp_path: Path) -> None:
    out = tmp_path / "index"
    build_index(gallery, embedder, out, progress=False)
    make_image(77, size=(64, 56)).save(gallery / "beta" / "extra.png")
    (gallery / "delta").mkdir()
    make_image(78, size=(64, 56)).save(gallery / "delta" / "d.png")
    report = add_images(out, embedder, [gallery / "beta" / "extra.png", gallery / "delta"], progress=False)
    assert (report.indexed, report.removed) == (2, 0)
    assert _items(out).keys() >= {"beta/extra.png", "delta/d.png"}
    outside = tmp_path / "outside.png"
    make_image(79).save(outside)
    with pytest.raises(ValueError, match="outside the index's gallery folder"):
        add_images(out, embedder, [outside], progress=False)


def test_shards_each_take_their_own_files(embedder: Embedder, gallery: Path, tmp_path: Path) -> None:
    reports = [
        build_index(gallery, embedder, tmp_path / f"shard{i}", shard=Shard(i, 2), progress=False)
        for i in range(2)
    ]
    assert sum(r.indexed for r in reports) == 9
    paths = [set(_items(tmp_path / f"shard{i}")) for i in range(2)]
    assert not paths[0] & paths[1]
    assert all(Shard(i, 2).owns(p) for i in range(2) for p in paths[i])
    with pytest.raises(ValueError, match="holds shard 0/2"):
        build_index(gallery, embedder, tmp_path / "shard0", shard=Shard(1, 2), progress=False)


def test_judgments_follow_their_items_when_another_model_re_embeds_the_index(
    embedder: Embedder, small_model: Path, gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    old_model = Embedder(small_model, threads=1)
    build_index(gallery, old_model, out, progress=False)
    before = _items(out)
    index = GalleryIndex.open(out)
    time = "2026-01-01T00:00:00+00:00"
    moved, gone, other = (
        before["beta/beta_0.png"][0],
        before["gamma/gamma_2.png"][0],
        before["alpha/alpha_0.png"][0],
    )
    kept = index.judgments.add(JudgedQuery(item=other), moved, 1, old_model.fingerprint, time)
    index.judgments.add(JudgedQuery(item=gone), other, -1, old_model.fingerprint, time)
    index.close()
    (gallery / "gamma" / "gamma_2.png").unlink()
    (gallery / "delta").mkdir()
    (gallery / "beta" / "beta_0.png").rename(gallery / "delta" / "moved.png")

    build_index(gallery, embedder, out, progress=False)
    index = GalleryIndex.open(out)
    try:
        assert list(index.judgments.scan()) == [
            kept
        ]  # the moved item's id and judgment kept; the gone one's not
    finally:
        index.close()
