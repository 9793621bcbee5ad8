"""An index directory: vectors, item metadata and manifest, opened and saved together."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.faiss_index import FaissIndex
from index.items import Item, ItemStore
from index.manifest import Manifest


class IndexMismatchError(ValueError):
    """The index was built with a different model (fingerprint or dimension) than the one in use."""


@dataclass(frozen=True)
class Hit:
    item: Item
    score: float
    rank: int


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class GalleryIndex:
    """``manifest.json`` + ``vectors.faiss`` + ``items.sqlite`` in one directory."""

    def __init__(self, directory: Path, manifest: Manifest, vectors: FaissIndex, items: ItemStore) -> None:
        self.directory = directory
        self.manifest = manifest
        self.vectors = vectors
        self.items = items

    @classmethod
    def create(
        cls, directory: Path, *, dim: int, model_fingerprint: str, gallery_root: Path | None
    ) -> GalleryIndex:
        directory.mkdir(parents=True, exist_ok=True)
        now = _now()
        manifest = Manifest(
            dim=dim,
            model_fingerprint=model_fingerprint,
            gallery_root=str(gallery_root.resolve()) if gallery_root else None,
            created=now,
            updated=now,
        )
        return cls(directory, manifest, FaissIndex(dim), ItemStore(directory))

    @classmethod
    def open(cls, directory: Path) -> GalleryIndex:
        manifest = Manifest.load(directory)
        vectors = FaissIndex.load(directory, manifest.dim)
        items = ItemStore(directory)
        if len(vectors) != len(items):
            raise ValueError(f"{directory} is inconsistent: {len(vectors)} vectors but {len(items)} items")
        return cls(directory, manifest, vectors, items)

    def check_model(self, fingerprint: str, dim: int) -> None:
        if dim != self.manifest.dim:
            raise IndexMismatchError(
                f"model embeds into {dim} dimensions but the index holds {self.manifest.dim}"
            )
        if fingerprint != self.manifest.model_fingerprint:
            raise IndexMismatchError(
                f"index was built with model {self.manifest.model_fingerprint[:12]} but the model in use is "
                f"{fingerprint[:12]}: rebuild the index with this model"
            )

    def add(self, vectors: np.ndarray, entries: Sequence[tuple[str, str | None, str]]) -> list[int]:
        """Add vectors with their ``(path, label, content_hash)`` metadata; returns the new ids."""
        if len(vectors) != len(entries):
            raise ValueError(f"{len(vectors)} vectors but {len(entries)} metadata rows")
        ids = self.items.add(entries)
        self.vectors.add(np.asarray(ids, dtype=np.int64), vectors)
        return ids

    def search(self, queries: np.ndarray, k: int) -> list[list[Hit]]:
        k = min(k, len(self))
        if k == 0:
            return [[] for _ in range(len(queries))]
        ids, scores = self.vectors.search(queries, k)
        items = self.items.get_many(sorted({int(i) for i in ids.ravel() if i >= 0}))
        return [
            [
                Hit(items[int(item_id)], float(score), rank)
                for rank, (item_id, score) in enumerate(zip(row_ids, row_scores, strict=True), start=1)
                if item_id >= 0 and int(item_id) in items
            ]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.vectors)

    def save(self) -> None:
        self.manifest.count = len(self)
        self.manifest.updated = _now()
        self.vectors.save(self.directory)
        self.manifest.save(self.directory)

    def close(self) -> None:
        self.items.close()


def replace_directory(source: Path, target: Path) -> None:
    """Move a fully written ``source`` directory onto ``target``, keeping the old one until the swap."""
    backup = None
    if target.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, backup / target.name)
    os.replace(source, target)
    if backup is not None:
        shutil.rmtree(backup)
