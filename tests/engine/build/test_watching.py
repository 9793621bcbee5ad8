"""``GalleryWatcher``: a real watchdog observer over a temporary gallery, the real embedder and index."""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.lib.images import image_bytes, make_image
from cli.main import app
from engine.build.indexing import build_index
from engine.build.report import BuildReport
from engine.build.watching import GalleryWatcher
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex
from index.protocol import Item
from tests.support.waiting import wait_until

SETTLE = 0.3
TIMEOUT = 60  # seconds for a batch to be embedded and saved on a busy 2-core machine


@pytest.fixture
def gallery(tmp_path: Path) -> Path:
    root = tmp_path / "gallery"
    for label_index, label in enumerate(["alpha", "beta"]):
        (root / label).mkdir(parents=True)
        for i in range(2):
            make_image(10 * label_index + i, size=(64, 56)).save(root / label / f"{label}_{i}.png")
    return root


@pytest.fixture
def running(gallery: Path, tmp_path: Path, embedder: Embedder) -> Iterator[GalleryWatcher]:
    watcher = GalleryWatcher(gallery, tmp_path / "index", embedder, settle=SETTLE)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            watcher.run(stop)
        except BaseException as err:  # surfaced by the test, not lost in the thread
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: watcher.caught_up.is_set() or errors, TIMEOUT, "the catch-up build")
    yield watcher
    stop.set()
    thread.join(timeout=TIMEOUT)
    assert not thread.is_alive()
    assert not errors, errors


def _items(index_dir: Path) -> dict[str, tuple[int, str | None]]:
    """path -> (id, label), as a fresh reader (another process) sees the saved index."""
    index = GalleryIndex.open(index_dir)
    try:
        return {item.path: (item.id, item.label) for item in index.items.scan()}
    finally:
        index.close()


def test_additions_changes_renames_moves_and_deletions_are_applied(
    running: GalleryWatcher, gallery: Path
) -> None:
    index_dir = running.index_dir
    before = _items(index_dir)
    assert set(before) == {"alpha/alpha_0.png", "alpha/alpha_1.png", "beta/beta_0.png", "beta/beta_1.png"}

    make_image(500, size=(64, 56)).save(gallery / "alpha" / "new.png")
    (gallery / "beta" / "beta_0.png").rename(gallery / "beta" / "renamed.png")
    (gallery / "gamma").mkdir()
    (gallery / "alpha" / "alpha_1.png").rename(gallery / "gamma" / "moved.png")
    (gallery / "beta" / "beta_1.png").unlink()
    make_image(600, size=(64, 56)).save(gallery / "alpha" / "alpha_0.png")  # new content, same path

    # The same paths can be in place before the change of alpha_0.png's content is applied (watchdog holds
    # events back to pair moves, so it may come a batch later): wait for every change to be counted.
    stats = running.stats
    wait_until(lambda: (stats.moved, stats.removed) == (2, 2), TIMEOUT, "the moves and removals")
    after = _items(index_dir)
    assert set(after) == {"alpha/alpha_0.png", "alpha/new.png", "beta/renamed.png", "gamma/moved.png"}
    assert after["beta/renamed.png"] == before["beta/beta_0.png"]  # a rename keeps the id
    assert after["gamma/moved.png"] == (before["alpha/alpha_1.png"][0], "gamma")  # a move: same id, new label
    assert after["alpha/alpha_0.png"][0] > max(i for i, _ in before.values())  # changed content: a new item
    assert (running.stats.indexed, running.stats.removed) == (4 + 2, 2)  # catch-up 4, then new + changed

    # A folder moved in from outside arrives as one directory event: its images are indexed too.
    outside = gallery.parent / "outside" / "delta"
    outside.mkdir(parents=True)
    make_image(700, size=(64, 56)).save(outside / "d.png")
    shutil.move(outside, gallery / "delta")
    wait_until(lambda: "delta/d.png" in _items(index_dir), TIMEOUT, "the moved-in folder's image")
    # And a whole folder deleted removes its items.
    shutil.rmtree(gallery / "gamma")
    wait_until(lambda: "gamma/moved.png" not in _items(index_dir), TIMEOUT, "the deleted folder's item")


def test_a_file_added_to_a_folder_is_the_only_file_read(running: GalleryWatcher, gallery: Path) -> None:
    """The folder's own "modified" event must not make the watcher hash its other files again (in a
    folder of thousands of 12-MP photos that is gigabytes read for one new file)."""
    reports: list[BuildReport] = []
    running.on_batch = lambda _, report: reports.append(report)
    make_image(900, size=(64, 56)).save(gallery / "alpha" / "added.png")
    wait_until(lambda: sum(report.indexed for report in reports) == 1, TIMEOUT, "the added file's batch")
    assert "alpha/added.png" in _items(running.index_dir)
    assert sum(report.unchanged for report in reports) == 0  # alpha_0.png and alpha_1.png were not read


def test_a_half_written_file_is_indexed_only_once_complete(running: GalleryWatcher, gallery: Path) -> None:
    index_dir = running.index_dir
    data = image_bytes(make_image(800, size=(120, 100)))
    target = gallery / "alpha" / "big.png"
    with target.open("wb") as handle:
        handle.write(data[: len(data) // 2])
        handle.flush()
        # The writer stalls for longer than the settle interval: the half file is looked at, fails to
        # decode and is skipped, not indexed.
        wait_until(lambda: running.stats.skipped >= 1, TIMEOUT, "the half-written file to be skipped")
        assert "alpha/big.png" not in _items(index_dir)
        handle.write(data[len(data) // 2 :])
    wait_until(lambda: "alpha/big.png" in _items(index_dir), TIMEOUT, "the completed file")
    index = GalleryIndex.open(index_dir)
    assert index.items.get_by_path("alpha/big.png").content_hash == hashlib.sha256(data).hexdigest()
    index.close()


def test_deleting_a_file_hands_its_item_to_a_copy(running: GalleryWatcher, gallery: Path) -> None:
    """Identical files are indexed once; deleting the indexed one must not take the content out of the
    index while a copy is still in the gallery: the copy takes over the item (same id)."""
    shutil.copyfile(gallery / "alpha" / "alpha_0.png", gallery / "beta" / "copy.png")
    wait_until(lambda: running.stats.batches >= 1, TIMEOUT, "the copy's batch")
    before = _items(running.index_dir)
    assert "beta/copy.png" not in before  # a copy is not a second item
    (gallery / "alpha" / "alpha_0.png").unlink()
    wait_until(lambda: running.stats.moved == 1, TIMEOUT, "the item moving to the copy")
    after = _items(running.index_dir)
    assert "alpha/alpha_0.png" not in after
    assert after["beta/copy.png"] == (before["alpha/alpha_0.png"][0], "beta")
    assert running.stats.removed == 0


def test_a_deletion_lists_only_what_its_batch_touched(running: GalleryWatcher, gallery: Path) -> None:
    """A batch with a deletion reads the gallery's unindexed files (a copy may take over the deleted item),
    but it must not list every unreadable file and copy in the folder again."""
    (gallery / "beta" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    shutil.copyfile(gallery / "alpha" / "alpha_1.png", gallery / "beta" / "copy.png")
    wait_until(lambda: running.stats.skipped >= 1, TIMEOUT, "the broken file's batch")
    reports: list[tuple[list[Path], BuildReport]] = []
    running.on_batch = lambda batch, report: reports.append((batch, report))

    (gallery / "alpha" / "alpha_0.png").unlink()
    (gallery / "alpha" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg either")
    skipped = lambda: [path for _, report in reports for path, _ in report.skipped]  # noqa: E731
    removed = lambda: sum(report.removed for _, report in reports)  # noqa: E731
    wait_until(lambda: removed() == 1 and "alpha/bad.jpg" in skipped(), TIMEOUT, "the deletion's batch")
    assert skipped() == ["alpha/bad.jpg"]
    assert [report.duplicates for _, report in reports] == [[]] * len(reports)


def test_another_index_taking_the_path_in_the_same_second_is_followed_as_another_index(
    gallery: Path, tmp_path: Path, embedder: Embedder, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both indexes created in one second (as a fast build-index after the watcher's catch-up can be): their
    # creation times are equal, and the watcher must still tell the new index from a save of its own.
    monkeypatch.setattr("index.gallery.now_utc", lambda: "2026-01-01T00:00:00+00:00")
    follows: list[tuple[str, str, bool]] = []
    watcher = GalleryWatcher(
        gallery, tmp_path / "index", embedder, settle=SETTLE, on_follow=lambda *args: follows.append(args)
    )
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    try:
        wait_until(watcher.caught_up.is_set, TIMEOUT, "the catch-up build")
        other = Embedder(small_model, threads=1)
        report = build_index(gallery, other, watcher.index_dir)
        assert report.reembedded == 4
        wait_until(lambda: follows, TIMEOUT, "the watcher to follow")
        assert follows == [(embedder.fingerprint, other.fingerprint, True)]
    finally:
        stop.set()
        thread.join(timeout=TIMEOUT)
    assert not thread.is_alive()


def test_a_deleted_item_stays_deleted_under_a_running_watcher(running: GalleryWatcher, gallery: Path) -> None:
    """Issue 42, finding 2: an item deleted by ``dmlsearch index remove`` (``DELETE /v1/items`` deletes
    the same way) while a watcher runs on its folder. The watcher follows the index the delete saved and
    catches it up with the folder, and the set-aside file's events (its new name in the trash among them)
    arrive: none of it indexes the photo again."""
    index = GalleryIndex.open(running.index_dir)
    deleted = index.items.get_by_path("alpha/alpha_0.png")
    index.close()
    assert deleted is not None
    removed = CliRunner().invoke(app, ["index", "remove", str(running.index_dir), "alpha/alpha_0.png"])
    assert removed.exit_code == 0, removed.output
    wait_until(lambda: running.stats.followed >= 1, TIMEOUT, "the watcher to follow the saved index")
    # A file added after the delete is applied after its events (which settled first): once it is
    # indexed, every event of the delete has been applied.
    make_image(950, size=(64, 56)).save(gallery / "beta" / "later.png")
    wait_until(lambda: "beta/later.png" in _items(running.index_dir), TIMEOUT, "the later file")
    items = _items(running.index_dir)
    assert set(items) == {"alpha/alpha_1.png", "beta/beta_0.png", "beta/beta_1.png", "beta/later.png"}
    assert deleted.content_hash not in {item.content_hash for item in _scan(running.index_dir)}


def _scan(index_dir: Path) -> list[Item]:
    index = GalleryIndex.open(index_dir)
    try:
        return list(index.items.scan())
    finally:
        index.close()
