"""Re-embed an index's gallery with another model into a new index directory (``dmlsearch index rebuild``).

The new index holds the same items as the old one: same gallery root, paths, labels, ids and times added,
each embedded again from its file by the new model, with the old index's options (index type, memory
budget, target recall). The old index is only read (its item store opened read-only), so a server can
go on serving it; the new one is one staged write (``index.staging``): written aside, each embedded batch
committed at once, and swapped into place with its model when complete: a killed rebuild run again
continues where it stopped.
Files gone from the gallery or no longer decodable are skipped and listed in the report. The old index's
judgments come along under the kept ids (those naming a skipped item are left out); an uploaded query's
embedding is dropped when the model changes (``index.judgments.carry``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.build.embedding import embed_files, hash_files
from engine.build.report import BuildReport
from engine.model.bundle import model_writer
from engine.model.embedder import Embedder
from foundation.defaults import BATCH_SIZE
from foundation.errors import ConflictError, InvalidInputError, NotFoundError
from index.gallery import GalleryIndex
from index.judgments import Judgment, carry
from index.manifest import Manifest
from index.protocol import CapabilityError, Entry, Item, Move
from index.staging import staged_write


class _KeepIds:
    """An item sink that writes re-embedded files under the ids, labels and times of the old items."""

    def __init__(self, index: GalleryIndex, by_path: dict[str, Item]) -> None:
        self.index = index
        self.by_path = by_path

    def add(self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes]) -> list[int]:
        old = [self.by_path[entry.path] for entry in entries]
        return self.index.copy_in(
            vectors,
            entries,
            signatures,
            added=[item.added for item in old],
            ids=[item.id for item in old],
        )


@dataclass(frozen=True)
class Source:
    """The index whose items are re-embedded: its manifest, gallery folder, items, the highest id it
    ever handed out, and its judgments."""

    directory: Path
    manifest: Manifest
    gallery_root: Path
    items: list[Item]
    last_id: int
    judgments: list[Judgment]


def read_source(index_dir: Path, gallery_root: Path | None) -> Source:
    """Read the items of ``index_dir`` without writing to it (a server may be serving it)."""
    manifest = Manifest.load(index_dir)
    if manifest.shard is not None:
        raise InvalidInputError(
            f"{index_dir} is shard {manifest.shard}: merge the shards first (dmlsearch index merge)"
        )
    if gallery_root is None:
        if manifest.gallery_root is None:
            raise InvalidInputError(f"{index_dir} records no gallery folder: name it (the gallery root)")
        gallery_root = Path(manifest.gallery_root)
    if not gallery_root.is_dir():
        raise NotFoundError(f"gallery folder {gallery_root} does not exist: name where the gallery is now")
    index = GalleryIndex.open(index_dir, read_only=True)
    try:
        if not index.capabilities.mergeable:
            raise CapabilityError(
                f"{index_dir} is a {manifest.backend} index: rebuild rebuilds indexes whose items copy in "
                "under their ids (FAISS; build a new Milvus collection with dmlsearch build-index)"
            )
        items, last_id = list(index.items.scan()), index.last_id()
        judgments = list(index.judgments.scan())
    finally:
        index.close()
    if not items:
        raise InvalidInputError(f"{index_dir} holds no items to re-embed")
    return Source(index_dir, manifest, gallery_root.resolve(), items, last_id, judgments)


def reembed(
    index: GalleryIndex,
    source: Source,
    embedder: Embedder,
    *,
    moves: Sequence[Move] = (),
    batch_size: int = BATCH_SIZE,
    progress: bool = True,
) -> BuildReport:
    """Embed the items of ``source`` with ``embedder`` into ``index`` under their ids, labels and times
    added; ``moves``: items whose file was renamed or moved since, re-embedded from their new path (and
    with its label). Items ``index`` already holds under the same id and path (an interrupted run's) are
    kept; others it holds are removed. The judgments of ``source`` follow their items."""
    moved = {move.id: move for move in moves}
    items = [
        dataclasses.replace(item, path=move.path, label=move.label) if (move := moved.get(item.id)) else item
        for item in source.items
    ]
    by_path = {item.path: item for item in items}
    report = BuildReport()
    index.reserve_ids(source.last_id)  # items added later never take the id of one removed before
    done = {
        item.id
        for item in index.items.scan()
        if (kept := by_path.get(item.path)) is not None and kept.id == item.id
    }
    stale = [item.id for item in index.items.scan() if item.id not in done]
    if stale:
        index.remove(stale)
    todo = [item for item in items if item.id not in done]
    report.unchanged = len(items) - len(todo)
    root = source.gallery_root
    files = hash_files(root, [root / item.path for item in todo], report, progress)
    files = [dataclasses.replace(f, label=by_path[f.relative].label) for f in files]
    embed_files(_KeepIds(index, by_path), embedder, files, report, batch_size=batch_size, progress=progress)
    same_ids = {item.id: item.id for item in index.items.scan()}
    carry(source.judgments, index.judgments, same_ids, embedder.fingerprint)
    return report


def rebuild_index(
    index_dir: Path,
    embedder: Embedder,
    out_dir: Path,
    *,
    gallery_root: Path | None = None,
    moves: Sequence[Move] = (),
    batch_size: int = BATCH_SIZE,
    progress: bool = True,
) -> BuildReport:
    """Write a new index at ``out_dir`` holding the items of ``index_dir`` embedded by ``embedder``.

    ``gallery_root``: where the gallery is now, if not where the old index recorded it. ``moves``: items
    whose file was renamed or moved since, re-embedded from their new path (and with its label) under
    their id. ``out_dir`` must be new (or empty); the old index is never written to.
    """
    index_dir, out_dir = index_dir.resolve(), out_dir.resolve()
    if out_dir == index_dir:
        raise InvalidInputError("the new index needs its own directory (--out): the old one is never changed")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConflictError(f"{out_dir} already exists and is not empty: choose a new directory")
    source = read_source(index_dir, gallery_root)

    def create(staging: Path) -> GalleryIndex:
        return GalleryIndex.create(
            staging,
            dim=embedder.dim,
            model_fingerprint=embedder.fingerprint,
            gallery_root=source.gallery_root,
            options=source.manifest.options,
        )

    with staged_write(out_dir, fingerprint=embedder.fingerprint, create=create) as staged:
        staged.index.set_gallery_root(source.gallery_root)
        report = reembed(
            staged.index, source, embedder, moves=moves, batch_size=batch_size, progress=progress
        )
        if len(staged.index) == 0:
            staged.discard()  # nothing worth resuming
            raise InvalidInputError(
                f"none of the {len(source.items)} gallery files of {index_dir} could be read"
            )
        report.rebuilt = staged.commit(model_writer(embedder.model_path), retune=True, progress=progress)
    return report
