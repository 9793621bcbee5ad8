"""An index directory: ``manifest.json`` plus a backend (FAISS files or a Milvus collection), used as one.

``GalleryIndex`` is the only way into an index directory: nothing else holds its backend, and nothing
else writes its manifest, which it fills from what the backend returns (``VectorIndex.built_index``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from foundation.atomic import remove_abandoned
from foundation.errors import DmlsearchError, ErrorKind
from foundation.families import Backend
from index.backends import capabilities_of, connect
from index.connection import MilvusConnection
from index.filters import ItemFilter, UnknownLabelError, match_labels
from index.items import now_utc
from index.judgments import JudgmentStore
from index.manifest import FLAT_REQUESTED, MANIFEST_NAME, DiskChange, Manifest, disk_change, manifest_stamp
from index.protocol import Capabilities, CapabilityError, Entry, Item, ItemCatalog, Move, VectorIndex
from index.selection import IndexOptions, IndexSpec

BACKENDS = tuple(Backend)
# Writes the model into an index directory (with its card) and returns the model file's name there.
ModelWriter = Callable[[Path], str]


class IndexMismatchError(DmlsearchError, ValueError):
    """The index was built with a different model (fingerprint or dimension) than the one in use."""

    kind = ErrorKind.CONFLICT
    code = "index_mismatch"


@dataclass(frozen=True)
class Hit:
    item: Item
    score: float
    rank: int


class GalleryIndex:
    """Search, add and remove over one index directory; ``save`` makes changes durable."""

    def __init__(self, directory: Path, manifest: Manifest, backend: VectorIndex) -> None:
        self.directory = directory
        self.manifest = manifest
        self._backend = backend
        manifest.built = backend.built_index()  # a server's index type is read when connecting
        self.stamp = manifest_stamp(directory)  # the manifest as this object last read or wrote it
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
        backend: str = Backend.FAISS,
        milvus: MilvusConnection | None = None,
        shard: str | None = None,
    ) -> GalleryIndex:
        """A new, empty index directory (its manifest is written at once, so a build can resume);
        ``milvus``: where the collection of an index that lives in a server is (recorded in its manifest)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        connection = MilvusConnection()  # only an index outside its folder records where it lives
        if milvus is not None and not capabilities_of(Backend(backend)).lives_in_folder:
            connection = milvus.absolute()
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
            milvus_uri=connection.uri,
            milvus_collection=connection.collection,
            created=now,
            updated=now,
            identity=uuid.uuid4().hex,
        )
        manifest.set_options(options or IndexOptions())
        index = cls(directory, manifest, connect(directory, manifest, create=True))
        manifest.save(directory)
        index.stamp = manifest_stamp(directory)
        return index

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        backend: str | None = None,
        milvus: MilvusConnection | None = None,
        mapped: bool = True,
        read_only: bool = False,
    ) -> GalleryIndex:
        """Open an index directory; a FAISS index is memory-mapped until its first change.

        ``backend``: refuse an index of another backend; ``milvus``: reach its Milvus collection otherwise
        than recorded when it was built (another address); ``mapped`` False: read the FAISS file
        into memory instead (a server: a file truncated under a mapping, ``cp new.faiss vectors.faiss``,
        kills the process with SIGBUS at its next search); ``read_only``: its items and vectors only,
        nothing written (the source of a merge or rebuild, which a server may be serving).
        """
        if not read_only:
            remove_abandoned(directory)  # before loading: a killed writer's half-written copies are litter
        # Stamped before reading: a save that lands while the files are read is a disk_change().
        stamp = manifest_stamp(directory)
        manifest = Manifest.load(directory)
        if backend is not None and backend != manifest.backend:
            raise ValueError(f"{directory} is a {manifest.backend} index, not {backend}")
        connection = connect(
            directory, manifest, create=False, milvus=milvus, mapped=mapped, read_only=read_only
        )
        index = cls(directory, manifest, connection)
        index.stamp = stamp
        return index

    @property
    def items(self) -> ItemCatalog:
        return self._backend.items

    @property
    def judgments(self) -> JudgmentStore:
        """The 👍/👎 judgments on this index's results (``index.judgments``)."""
        return self._backend.judgments

    @property
    def capabilities(self) -> Capabilities:
        return self._backend.capabilities

    def gallery_mark(self) -> str | None:
        """The mark of the gallery folder the processes writing to this index share (None: none recorded,
        or an index that lives in its folder)."""
        return self._backend.gallery_mark()

    def record_gallery_mark(self, mark: str) -> None:
        self._backend.record_gallery_mark(mark)

    def _require(self, granted: bool, refusal: str) -> None:
        """Go on only where the backend declares the capability (``granted``), else refuse, saying why."""
        if not granted:
            raise CapabilityError(f"{self.directory} is a {self.manifest.backend} index: {refusal}")

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
        return self._backend.add(vectors, entries, signatures)

    def copy_in(
        self,
        vectors: np.ndarray,
        entries: Sequence[Entry],
        signatures: Sequence[bytes | None],
        *,
        added: Sequence[str],
        ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Add items copied from another index, keeping their times added (and ``ids``, if given)."""
        self._require(self.capabilities.mergeable, "it takes no items copied in under their ids and times")
        return self._backend.copy_in(vectors, entries, signatures, added=added, ids=ids)

    def reserve_ids(self, last_id: int) -> None:
        """New items get ids above ``last_id``: those of the index these items were copied from."""
        self._require(self.capabilities.mergeable, "its ids cannot be reserved")
        self._backend.reserve_ids(last_id)

    def last_id(self) -> int:
        """The highest id this index ever handed out, removed items' included."""
        self._require(self.capabilities.mergeable, "it does not record the highest id it handed out")
        return self._backend.last_id()

    def remove(self, ids: Sequence[int]) -> int:
        """Remove items by id, and the judgments naming them; returns how many existed. Ids are never
        reused."""
        return self._backend.remove(ids)

    def move(self, moves: Sequence[Move]) -> int:
        """New paths and labels for renamed or moved files; returns how many items existed."""
        return self._backend.move(moves)

    def set_taken(self, taken: Mapping[int, str]) -> int:
        """Record when items' photos were taken, by id (items indexed before it was kept)."""
        return self._backend.set_taken(taken)

    def signatures(self, ids: Sequence[int] | None = None) -> dict[int, bytes]:
        """The stored perceptual signatures of ``ids`` (default: every item's), by item id."""
        return self._backend.signatures(ids)

    def set_gallery_root(self, gallery_root: Path) -> None:
        """Where the gallery's files are now (recorded at the next save)."""
        self.manifest.gallery_root = str(gallery_root.resolve())

    def store_model(self, model: ModelWriter) -> None:
        """Put the model the vectors were embedded with into the directory; the manifest names it."""
        self.manifest.model_file = model(self.directory)

    def build(
        self,
        options: IndexOptions | None = None,
        *,
        retune: bool = True,
        partitions: Sequence[np.ndarray] | None = None,
        progress: bool = False,
    ) -> bool:
        """Build or rebuild the search structure for the current size (where the backend builds locally).

        Rebuilds from the stored vectors, without re-embedding, when ``options`` (default: the manifest's)
        pick another index than the one built; otherwise re-tunes when ``retune``. ``partitions``: ids
        per shard, built as parts and merged (``index.merge``). Returns whether it rebuilt. A shard
        directory only stores vectors: ``index.merge`` builds the index.
        """
        if options is not None:
            self.manifest.set_options(options)
        if not self._builds_here:
            return False
        rebuilt = self._backend.build(
            self.manifest.options, retune=retune, partitions=partitions, progress=progress
        )
        self.manifest.built = self._backend.built_index()
        return rebuilt

    def search(self, queries: np.ndarray, k: int, where: ItemFilter | None = None) -> list[list[Hit]]:
        """The top-``k`` hits of each query, best first (fewer when the gallery is smaller); ``where``
        restricts them to the items it lets through."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if where is not None and where.labels:
            where = where.with_labels(self._match_labels(where.labels))
        ids, scores = self.nearest(queries, k, where)
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

    def nearest(
        self, queries: np.ndarray, k: int, where: ItemFilter | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The backend's raw answer: ``(ids, scores)``, both (n, k), id -1 where fewer than k items exist."""
        return self._backend.search(queries, k, where)

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
        return self._backend.vectors(ids)

    def __len__(self) -> int:
        return len(self._backend)

    def describe(self) -> dict[str, object]:
        """The manifest plus live facts: item count, vectors in the FAISS index, files and their sizes,
        the backend's capabilities. What was requested and built is given flat, as ``index stats`` always
        printed it."""
        info: dict[str, object] = self.manifest.model_dump(exclude={"requested", "built"})
        built = self.manifest.built
        info.update(built.model_dump())
        requested = dict(self.manifest.requested)
        info.update({flat: requested[name] for flat, name in FLAT_REQUESTED.items()})
        info["count"] = len(self)
        info["files"] = {p.name: p.stat().st_size for p in sorted(self.directory.iterdir()) if p.is_file()}
        info.update(self._backend.stats())
        info["capabilities"] = asdict(self.capabilities)
        if built.index_spec is not None:
            spec = IndexSpec.parse(built.index_type, built.index_spec, self.manifest.dim)
            info["estimated_memory_bytes"] = spec.memory_bytes(len(self))
        return info

    @property
    def _builds_here(self) -> bool:
        """The backend builds locally (FAISS) and this is not a shard, which only stores vectors."""
        return self.capabilities.local_build and self.manifest.shard is None

    def save(self) -> None:
        """Make every change durable: a fresh local index is built first; then files, then the manifest."""
        if self._builds_here and not self._backend.built and len(self) > 0:
            self._backend.build(self.manifest.options, retune=True)
        self._backend.save()
        self.manifest.built = self._backend.built_index()
        self.manifest.count = len(self)
        self.manifest.updated = now_utc()
        self.manifest.save(self.directory)
        self.stamp = manifest_stamp(self.directory)  # our own save: nothing to reload

    def disk_change(self) -> DiskChange:
        """Whether another process (or another object) saved this index since this one read or saved it,
        or another index took its directory."""
        return disk_change(self.directory, self.stamp, self.manifest.origin)

    def close(self) -> None:
        self._backend.close()
