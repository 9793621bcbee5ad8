"""Keep an index in sync with a gallery folder while files are added, changed, moved and deleted.

watchdog reports file events; :class:`engine.changes.ChangeBatcher` debounces them into batches of
settled paths (a file still being copied waits; a burst of 1,000 copies becomes a few batched adds).
Each batch goes through build-index's own content-hash sync (:func:`engine.indexing.sync_files`):
renamed and moved files keep their ids, changed files are embedded again, deleted files are removed,
and a file that does not decode yet (half written) is skipped until its next change. The index is
saved after every batch, so a server on the same index reloads it
(``app.reload.Reloader.refresh``), and a killed watcher restarts by catching up with
:func:`engine.indexing.build_index`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from watchdog.observers import Observer

from engine.changes import DEFAULT_MAX_BATCH, DEFAULT_SETTLE_SECONDS, ChangeBatcher
from engine.defaults import BATCH_SIZE
from engine.embedder import Embedder
from engine.images import is_image_file, list_images
from engine.indexing import BuildReport, build_index, sync_files
from index.gallery import GalleryIndex


@dataclass
class WatchStats:
    batches: int = 0
    indexed: int = 0
    moved: int = 0
    removed: int = 0
    skipped: int = 0


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
        on_batch: Callable[[list[Path], BuildReport], None] | None = None,
    ) -> None:
        self.gallery = gallery.resolve()
        self.index_dir = index_dir
        self.embedder = embedder
        self.batcher = ChangeBatcher(settle=settle, max_batch=max_batch)
        self.batch_size = batch_size
        self.progress = progress
        self.on_batch = on_batch
        self.stats = WatchStats()
        self.caught_up = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Watch until ``stop`` is set. Events are recorded from before the catch-up, so none is lost."""
        observer = Observer()
        observer.schedule(self.batcher, str(self.gallery), recursive=True)
        observer.start()
        try:
            report = build_index(self.gallery, self.embedder, self.index_dir, progress=self.progress)
            self._record([], report)
            self.caught_up.set()
            index = GalleryIndex.open(self.index_dir)
            try:
                index.check_model(self.embedder.fingerprint, self.embedder.dim)
                while batch := self.batcher.next_batch(stop):
                    self._record(batch, self.apply(index, batch))
            finally:
                index.close()
        finally:
            observer.stop()
            observer.join()

    def apply(self, index: GalleryIndex, paths: list[Path]) -> BuildReport:
        """Sync the files at (and below) ``paths``; stored items whose file is gone are removed or moved."""
        files: set[Path] = set()
        for path in paths:
            if path.is_dir():
                files.update(list_images(path))
            elif is_image_file(path):
                files.add(path)
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
        if len(index) > 0:
            report.rebuilt = index.build(retune=False)
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
