"""Re-embed an index's gallery with another model into a new index directory (``dmlsearch index rebuild``).

The new index holds the same items as the old one: same gallery root, paths, labels, ids and times added,
each embedded again from its file by the new model, with the old index's options (index type, memory
budget, target recall). The old index is only read (its item store opened read-only), so a server can
go on serving it; the new one is written aside (``.NEW.rebuild``), each embedded batch committed at once,
and renamed into place when complete: a killed rebuild run again continues where it stopped.
Files gone from the gallery or no longer decodable are skipped and listed in the report.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.bundle import store_model
from engine.defaults import BATCH_SIZE
from engine.embedder import Embedder
from engine.indexing import BuildReport, embed_files, hash_files
from index.errors import ConflictError, InvalidInputError, NotFoundError
from index.gallery import GalleryIndex
from index.items import ItemStore
from index.manifest import MANIFEST_NAME, Manifest
from index.protocol import Entry, Item, Move


class _KeepIds:
    """An item sink that writes re-embedded files under the ids, labels and times of the old items."""

    def __init__(self, store: ItemStore, by_path: dict[str, Item]) -> None:
        self.store = store
        self.by_path = by_path

    def add(self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes]) -> list[int]:
        old = [self.by_path[entry.path] for entry in entries]
        return self.store.add(
            vectors,
            entries,
            added=[item.added for item in old],
            ids=[item.id for item in old],
            signatures=signatures,
        )


def _source(index_dir: Path, gallery_root: Path | None) -> tuple[Manifest, Path, list[Item], int]:
    """The old index's manifest, gallery folder, items and the highest id it ever handed out."""
    manifest = Manifest.load(index_dir)
    if manifest.backend != "faiss":
        raise InvalidInputError(
            f"{index_dir} is a {manifest.backend} index: rebuild rebuilds FAISS indexes (build a new "
            "Milvus collection with dmlsearch build-index)"
        )
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
    store = ItemStore(index_dir, manifest.dim, read_only=True)
    try:
        items, last_id = list(store.scan()), store.last_id()
    finally:
        store.close()
    if not items:
        raise InvalidInputError(f"{index_dir} holds no items to re-embed")
    return manifest, gallery_root.resolve(), items, last_id


def _staging(out_dir: Path, embedder: Embedder, gallery_root: Path, manifest: Manifest) -> GalleryIndex:
    """The half-built new index of an earlier run for this model, or a fresh one."""
    staging = out_dir.parent / f".{out_dir.name}.rebuild"
    if (staging / MANIFEST_NAME).exists():
        if Manifest.load(staging).model_fingerprint == embedder.fingerprint:
            index = GalleryIndex.open(staging)
            index.manifest.gallery_root = str(gallery_root)
            return index
        shutil.rmtree(staging)  # an abandoned rebuild with another model
    elif staging.exists():
        shutil.rmtree(staging)  # killed before its manifest was written: nothing stored yet
    return GalleryIndex.create(
        staging,
        dim=embedder.dim,
        model_fingerprint=embedder.fingerprint,
        gallery_root=gallery_root,
        options=manifest.options,
    )


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
    manifest, root, items, last_id = _source(index_dir, gallery_root)
    moved = {move.id: move for move in moves}
    items = [
        dataclasses.replace(item, path=move.path, label=move.label) if (move := moved.get(item.id)) else item
        for item in items
    ]
    by_path = {item.path: item for item in items}
    report = BuildReport()
    index = _staging(out_dir, embedder, root, manifest)
    try:
        store = index.backend.store
        store.reserve_ids(last_id)  # items added later never take the id of one removed before
        # Items already re-embedded by an earlier run under the same id and path are kept.
        done = {
            item.id
            for item in store.scan()
            if (source := by_path.get(item.path)) is not None and source.id == item.id
        }
        stale = [item.id for item in store.scan() if item.id not in done]
        if stale:
            store.remove(stale)
        todo = [item for item in items if item.id not in done]
        report.unchanged = len(items) - len(todo)
        files = hash_files(root, [root / item.path for item in todo], report, progress)
        files = [dataclasses.replace(f, label=by_path[f.relative].label) for f in files]
        embed_files(
            _KeepIds(store, by_path), embedder, files, report, batch_size=batch_size, progress=progress
        )
        if len(store) == 0:
            shutil.rmtree(index.directory)  # nothing worth resuming
            raise InvalidInputError(f"none of the {len(items)} gallery files of {index_dir} could be read")
        report.rebuilt = index.build(retune=True, progress=progress)
        index.manifest.model_file = store_model(index.directory, embedder.model_path)
        index.save()
    finally:
        index.close()
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    index.directory.rename(out_dir)
    return report
