"""An index directory: ``manifest.json`` plus a backend (FAISS files or a Milvus collection), used as one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.atomic import remove_abandoned
from index.errors import DmlsearchError, ErrorKind
from index.faiss_backend import FaissBackend
from index.families import Backend
from index.filters import ItemFilter, UnknownLabelError, match_labels
from index.items import now_utc
from index.manifest import MANIFEST_NAME, Manifest
from index.protocol import Entry, Item, ItemCatalog, Move, VectorIndex
from index.selection import IndexOptions, IndexSpec

BACKENDS = tuple(Backend)


class IndexMismatchError(DmlsearchError, ValueError):
    """The index was built with a different model (fingerprint or dimension) than the one in use."""

    kind = ErrorKind.CONFLICT
    code = "index_mismatch"


@dataclass(frozen=True)
class Hit:
    item: Item
    score: float
    rank: int


def _connect(
    directory: Path, manifest: Manifest, *, create: bool, milvus_uri: str | None = None, mapped: bool = True
) -> VectorIndex:
    if manifest.backend == "milvus":
        from index.milvus_backend import MilvusBackend  # pymilvus is an optional extra

        return MilvusBackend.connect(directory, manifest, uri=milvus_uri)
    if create:
        return FaissBackend.create(directory, manifest)
    return FaissBackend.open(directory, manifest, mapped=mapped)


class GalleryIndex:
    """Search, add and remove over one index directory; ``save`` makes changes durable."""

    def __init__(self, directory: Path, manifest: Manifest, backend: VectorIndex) -> None:
        self.directory = directory
        self.manifest = manifest
        self.backend = backend
        self.stamp = self._disk_stamp()  # the manifest as this object last read or wrote it
        self._labels: frozenset[str] | None = None  # the stored labels, as last read (see _match_labels)

    @classmethod
    def create(
        cls,
        directory: Path,
        *,
        dim: int,
        model_fingerprint: str,
        gallery_root: Path | None,
        options: IndexOptions | None = None,
        backend: str = "faiss",
        milvus_uri: str | None = None,
        milvus_collection: str | None = None,
        shard: str | None = None,
    ) -> GalleryIndex:
        """A new, empty index directory (its manifest is written at once, so a build can resume)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        directory.mkdir(parents=True, exist_ok=True)
        if (directory / MANIFEST_NAME).exists():
            raise FileExistsError(f"{directory} already holds an index")
        now = now_utc()
        manifest = Manifest(
            backend=backend,
            dim=dim,
            model_fingerprint=model_fingerprint,
            gallery_root=str(gallery_root.resolve()) if gallery_root else None,
            shard=shard,
            milvus_uri=_absolute_local(milvus_uri),
            milvus_collection=milvus_collection if backend == "milvus" else None,
            created=now,
            updated=now,
        )
        manifest.set_options(options or IndexOptions())
        index = cls(directory, manifest, _connect(directory, manifest, create=True))
        manifest.save(directory)
        index.stamp = index._disk_stamp()
        return index

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        backend: str | None = None,
        milvus_uri: str | None = None,
        mapped: bool = True,
    ) -> GalleryIndex:
        """Open an index directory; a FAISS index is memory-mapped until its first change.

        ``backend``: refuse an index of another backend; ``milvus_uri``: reach its Milvus collection at
        another address than the one recorded when it was built; ``mapped`` False: read the FAISS file
        into memory instead (a server: a file truncated under a mapping, ``cp new.faiss vectors.faiss``,
        kills the process with SIGBUS at its next search).
        """
        remove_abandoned(directory)  # before loading: a killed writer's half-written copies are litter
        manifest = Manifest.load(directory)
        if backend is not None and backend != manifest.backend:
            raise ValueError(f"{directory} is a {manifest.backend} index, not {backend}")
        connection = _connect(directory, manifest, create=False, milvus_uri=milvus_uri, mapped=mapped)
        return cls(directory, manifest, connection)

    @property
    def items(self) -> ItemCatalog:
        return self.backend.items

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

    def add(
        self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes | None] | None = None
    ) -> list[int]:
        """Add vectors with their ``(path, label, content_hash)`` metadata and perceptual signatures;
        returns the new ids."""
        return self.backend.add(vectors, entries, signatures)

    def remove(self, ids: Sequence[int]) -> int:
        """Remove items by id; returns how many existed. Ids are never reused."""
        return self.backend.remove(ids)

    def move(self, moves: Sequence[Move]) -> int:
        """New paths and labels for renamed or moved files; returns how many items existed."""
        return self.backend.move(moves)

    def set_taken(self, taken: Mapping[int, str]) -> int:
        """Record when items' photos were taken, by id (items indexed before it was kept)."""
        return self.backend.set_taken(taken)

    def build(
        self, options: IndexOptions | None = None, *, retune: bool = True, progress: bool = False
    ) -> bool:
        """Build or rebuild the search structure for the current size (FAISS; Milvus indexes itself).

        Rebuilds from the stored vectors, without re-embedding, when ``options`` (default: the manifest's)
        pick another index than the one built; otherwise re-tunes when ``retune``. Returns whether it
        rebuilt. A FAISS shard directory only stores vectors: ``index.merge`` builds the index.
        """
        if options is not None:
            self.manifest.set_options(options)
        if not self._builds_faiss:
            return False
        return self.backend.build(self.manifest.options, retune=retune, progress=progress)

    def search(self, queries: np.ndarray, k: int, where: ItemFilter | None = None) -> list[list[Hit]]:
        """The top-``k`` hits of each query, best first (fewer when the gallery is smaller); ``where``
        restricts them to the items it lets through."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if where is not None and where.labels:
            where = where.with_labels(self._match_labels(where.labels))
        ids, scores = self.backend.search(queries, k, where)
        # Quantised (PQ) and float-rounded inner products can stray past +-1: report true cosine bounds.
        scores = np.clip(scores, -1.0, 1.0)
        items = self.items.get_many(sorted({int(i) for i in ids.ravel() if i >= 0}))
        return [
            [
                Hit(items[int(item_id)], float(score), rank)
                for rank, (item_id, score) in enumerate(zip(row_ids, row_scores, strict=True), start=1)
                if item_id >= 0 and int(item_id) in items
            ]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]

    def _match_labels(self, wanted: tuple[str, ...]) -> tuple[str, ...]:
        """The stored labels ``wanted`` names, ignoring case (``index.filters.match_labels``).

        The stored labels are read once and again only when a label is not among them (one added since,
        also by another process): counting them takes a scan on Milvus. A label whose items are all gone
        may stay known until then, which only makes its filter find nothing.
        """
        if self._labels is not None:
            try:
                return match_labels(wanted, self._labels)
            except UnknownLabelError:
                pass
        self._labels = frozenset(self.items.label_counts())
        return match_labels(wanted, self._labels)

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of ``ids``, in that order (exact, whatever the search structure compresses)."""
        return self.backend.vectors(ids)

    def __len__(self) -> int:
        return len(self.backend)

    def describe(self) -> dict[str, object]:
        """The manifest plus live facts: item count, vectors in the FAISS index, files and their sizes."""
        info: dict[str, object] = self.manifest.model_dump()
        info["count"] = len(self)
        info["files"] = {p.name: p.stat().st_size for p in sorted(self.directory.iterdir()) if p.is_file()}
        info.update(self.backend.stats())
        if self.manifest.index_spec is not None:
            spec = IndexSpec(self.manifest.index_type, self.manifest.index_spec, self.manifest.dim)
            info["estimated_memory_bytes"] = spec.memory_bytes(len(self))
        return info

    @property
    def _builds_faiss(self) -> bool:
        """A FAISS index is built here; Milvus indexes itself and FAISS shards only store vectors."""
        return self.backend.builds_locally and self.manifest.shard is None

    def save(self) -> None:
        """Make every change durable: a fresh FAISS index is built first; then files, then the manifest."""
        if self._builds_faiss and not self.backend.built and len(self) > 0:
            self.backend.build(self.manifest.options, retune=True)
        self.backend.save()
        self.manifest.count = len(self)
        self.manifest.updated = now_utc()
        self.manifest.save(self.directory)
        self.stamp = self._disk_stamp()  # our own save: nothing to reload

    def _disk_stamp(self) -> tuple[int, int] | None:
        """Identifies the manifest on disk: every save replaces it atomically (a new inode)."""
        try:
            stat = (self.directory / MANIFEST_NAME).stat()
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    def saved_elsewhere(self) -> bool:
        """Whether another process (or another object) saved this index since this one read or saved it."""
        stamp = self._disk_stamp()
        return stamp is not None and stamp != self.stamp

    def close(self) -> None:
        self.backend.close()


def _absolute_local(uri: str | None) -> str | None:
    """Local Milvus Lite paths given on the command line are made absolute; remote URIs kept as given."""
    if uri is None or "://" in uri:
        return uri
    return str(Path(uri).resolve())


def replace_directory(source: Path, target: Path) -> None:
    """Move a fully written ``source`` directory onto ``target``, keeping the old one until the swap."""
    backup = None
    if target.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, backup / target.name)
    os.replace(source, target)
    if backup is not None:
        shutil.rmtree(backup)
