"""Keep an index in sync with a gallery folder while files are added, changed, moved and deleted.

watchdog reports file events; :class:`engine.build.changes.ChangeBatcher` debounces them into batches of
settled paths (a file still being copied waits; a burst of 1,000 copies becomes a few batched adds).
Each batch goes through build-index's own content-hash sync (:func:`engine.build.sync.sync_files`):
renamed and moved files keep their ids, changed files are embedded again, deleted files are removed,
and a file that does not decode yet (half written) is skipped until its next change. The index is
saved after every batch, so a server on the same index reloads it
(``app.reload.Reloader.refresh``), and a killed watcher restarts by catching up with
:func:`engine.build.indexing.build_index`.

The watcher follows the index at the path it was given, as the server's index poller does: when another
index takes that path (a promotion: a link repointed to a rebuilt index, or ``build-index --model NEW``
swapping one in), it switches to it and to the model it carries, and catches it up with the folder, so
that no photo added during or after the promotion lands in the index no longer served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from watchdog.observers import Observer

from engine.build.changes import DEFAULT_MAX_BATCH, DEFAULT_SETTLE_SECONDS, ChangeBatcher
from engine.build.indexing import build_index
from engine.build.report import BuildReport
from engine.build.sync import sync_files
from engine.gallery.files import in_trash, is_image_file, list_images
from engine.model.bundle import locate_model
from engine.model.embedder import Embedder
from foundation.defaults import BATCH_SIZE
from index.gallery import GalleryIndex
from index.manifest import DiskChange

# How often an idle watcher looks whether another index took its path (the server polls as often).
FOLLOW_SECONDS = 2.0


class IndexChanged(Exception):
    """Another process saved the watched index, or another index took its path: the watcher follows it, and
    a batch being applied is caught up instead."""

    def __init__(self, change: DiskChange) -> None:
        super().__init__(change.value)
        self.change = change


@dataclass
class WatchStats:
    batches: int = 0
    indexed: int = 0
    moved: int = 0
    removed: int = 0
    skipped: int = 0
    followed: int = 0  # times another index took the watched path and the watcher switched to it


class GalleryWatcher:
    """Catches an index up with its gallery folder, then applies the folder's changes batch by batch."""

    def __init__(
        self,
        gallery: Path,
        index_dir: Path,
        embedder: Embedder,
        *,
        settle: float = DEFAULT_SETTLE_SECONDS,
        max_batch: int = DEFAULT_MAX_BATCH,
        batch_size: int = BATCH_SIZE,
        progress: bool = False,
        threads: int = 0,
        on_batch: Callable[[list[Path], BuildReport], None] | None = None,
        on_follow: Callable[[str, str, bool], None] | None = None,
    ) -> None:
        self.gallery = gallery.resolve()
        self.index_dir = index_dir
        self.embedder = embedder
        self.batcher = ChangeBatcher(settle=settle, max_batch=max_batch)
        self.batch_size = batch_size
        self.progress = progress
        self.threads = threads  # onnxruntime threads of the model a followed index carries
        self.on_batch = on_batch
        # (previous model fingerprint, new one, whether another index took the path rather than another
        # process saving this one) when the watcher follows the index at its path.
        self.on_follow = on_follow
        self.stats = WatchStats()
        self.caught_up = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Watch until ``stop`` is set. Events are recorded from before the catch-up, so none is lost."""
        observer = Observer()
        observer.schedule(self.batcher, str(self.gallery), recursive=True)
        observer.start()
        index = None
        try:
            index = self._catch_up()
            self.caught_up.set()
            while not stop.is_set():
                batch = self.batcher.next_batch(stop, timeout=FOLLOW_SECONDS)
                try:
                    _require_unchanged(index)
                    if batch:
                        self._record(batch, self.apply(index, batch))
                except IndexChanged as changed:
                    index.close()
                    index = None
                    index = self._follow(changed.change)
        finally:
            if index is not None:
                index.close()
            observer.stop()
            observer.join()

    def _catch_up(self) -> GalleryIndex:
        """Bring the index at the watched path up to date with the folder (as build-index does); open it."""
        report = build_index(self.gallery, self.embedder, self.index_dir, progress=self.progress)
        self._record([], report)
        index = GalleryIndex.open(self.index_dir)
        try:
            index.check_model(self.embedder.fingerprint, self.embedder.dim)
        except ValueError:
            index.close()
            raise
        return index

    def _follow(self, change: DiskChange) -> GalleryIndex:
        """Another index took the watched path, or another process saved it (``change``): embed with the
        model it carries from now on, and catch it up with the folder (the changes applied to the old one
        included)."""
        previous = self.embedder.fingerprint
        replaced = change is DiskChange.REPLACED
        model = locate_model(self.index_dir)
        if model.card.fingerprint != previous:
            self.embedder = Embedder(model.path, threads=self.threads, card=model.card)
        self.stats.followed += 1
        if self.on_follow is not None:
            self.on_follow(previous, self.embedder.fingerprint, replaced)
        return self._catch_up()

    def apply(self, index: GalleryIndex, paths: list[Path]) -> BuildReport:
        """Sync the files at (and below) ``paths``; stored items whose file is gone are removed or moved."""
        files: set[Path] = set()
        paths = [path for path in paths if not in_trash(path, self.gallery)]  # set aside, not added
        for path in paths:
            if path.is_dir():
                files.update(list_images(path))
            elif is_image_file(path):
                files.add(path)
        touched = {path.relative_to(self.gallery).as_posix() for path in files}
        if any(not path.exists() for path in paths):
            files.update(self._unindexed(index))
        report = BuildReport()
        sync_files(
            index,
            self.gallery,
            sorted(files),
            self.embedder,
            report,
            gone=lambda relative: not (self.gallery / relative).is_file(),
            batch_size=self.batch_size,
            progress=self.progress,
        )
        # The unindexed files were read only so that a copy can take over a deleted item: that they are
        # still unreadable or copies is no news of this batch (it listed every one of them again).
        report.skipped = [(path, why) for path, why in report.skipped if path in touched]
        report.duplicates = [(path, first) for path, first in report.duplicates if path in touched]
        if len(index) > 0:
            report.rebuilt = index.build(retune=False)
        _require_unchanged(index)  # saving now would write over the index that took the path
        index.save()
        return report

    def _unindexed(self, index: GalleryIndex) -> list[Path]:
        """The gallery's images that are no item: copies of indexed files (identical content is indexed
        once) and unreadable files. When a file is deleted, a copy of it must take over its item instead of
        its content leaving the index; only these few files are read, not the whole folder."""
        indexed = {item.path for item in index.items.scan()}
        return [
            path
            for path in list_images(self.gallery)
            if path.relative_to(self.gallery).as_posix() not in indexed
        ]

    def _record(self, batch: list[Path], report: BuildReport) -> None:
        self.stats.batches += bool(batch)
        self.stats.indexed += report.indexed
        self.stats.moved += report.moved
        self.stats.removed += report.removed
        self.stats.skipped += len(report.skipped)
        if self.on_batch is not None:
            self.on_batch(batch, report)


def _require_unchanged(index: GalleryIndex) -> None:
    change = index.disk_change()
    if change is not DiskChange.UNCHANGED:
        raise IndexChanged(change)
