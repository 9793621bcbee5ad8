"""The FAISS backend: ``vectors.faiss`` derived from the items and vectors stored in ``items.sqlite``.

SQLite is the source of truth and commits every ``add`` at once; the FAISS file is written atomically by
``save``. If a process dies in between, the next ``open`` finds the two out of step and brings the
FAISS index back in line with the store (adding or removing the difference), so nothing stored is lost.
An HNSW graph keeps removed items as tombstones, which are not written to its file: ``open`` marks the
graph's ids that the store no longer holds again, the same step.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from foundation.errors import InvalidInputError
from foundation.families import IndexType
from index.faiss_build import build_faiss_index
from index.faiss_build import retune as retune_index
from index.faiss_index import FaissIndex
from index.filters import ItemFilter
from index.items import ItemStore
from index.judgments import SqliteJudgments
from index.manifest import BuiltIndex, Manifest
from index.protocol import Capabilities, CapabilityError, Entry, IndexNotBuiltError, Move, normalize_rows
from index.selection import IndexOptions, IndexSpec, choose_index
from index.sources import StoreSource
from index.tuning import Tuning, tuning_parameter

log = logging.getLogger("dmlsearch.index")
# Adds and removals (a watcher, `index add`) keep the tuned nprobe/efSearch; once the item count has moved
# this fraction away from the count they were tuned at, a build re-tunes them even when not asked to: the
# recall they give drifts as the inverted lists fill, more so with new kinds of images the coarse
# quantizer was not trained on, and the recall the manifest reports would no longer be measured.
RETUNE_AFTER_CHANGE = 0.25
# Removing from an HNSW graph leaves tombstones (index/faiss_index.py). They still take part in every
# search's beam without being returned, so the recall tuned for the graph slowly drifts down as they pile
# up; past this share of the graph it is rebuilt from the stored vectors without them.
HNSW_MAX_REMOVED = 0.1


class FaissBackend:
    FILE_NAME = "vectors.faiss"
    # Before the search structure is built: its tuning parameter comes with it (``capabilities``).
    CAPABILITIES: ClassVar[Capabilities] = Capabilities(
        local_build=True,
        removes_in_place=True,  # an HNSW graph keeps tombstones, rebuilt past HNSW_MAX_REMOVED
        mergeable=True,
        gpu_capable=True,  # with faiss-gpu and a GPU, not HNSW (index.faiss_index)
        tuning_parameter=None,
        lives_in_folder=True,
        reopen_to_see_saves=True,
        lists_items_cheaply=True,  # items.sqlite
    )

    def __init__(
        self, directory: Path, manifest: Manifest, store: ItemStore, index: FaissIndex | None
    ) -> None:
        self.directory = directory
        self.shard = manifest.shard
        self.options = manifest.options  # what builds aim for until ``build`` is told otherwise
        self._built = manifest.built  # what was built, as this backend reports it (``built_index``)
        self.dim = manifest.dim
        self.store = store
        self.index = index
        self._dirty = False

    @classmethod
    def create(cls, directory: Path, manifest: Manifest) -> FaissBackend:
        return cls(directory, manifest, ItemStore(directory, manifest.dim), None)

    @classmethod
    def open(
        cls, directory: Path, manifest: Manifest, *, mapped: bool = True, read_only: bool = False
    ) -> FaissBackend:
        """Open (memory-mapped unless not ``mapped``); reconcile the FAISS index with the store if a crash
        left them apart. ``read_only``: the items and their vectors only, without the right to change
        them and without the FAISS index (reading an index another process may serve)."""
        if read_only:
            return cls(directory, manifest, ItemStore(directory, manifest.dim, read_only=True), None)
        items = directory / ItemStore.FILE_NAME
        if manifest.count and (not items.exists() or items.stat().st_size == 0):
            # SQLite would start an empty store, and reconciling would then empty the index too.
            raise InvalidInputError(
                f"{items} is missing or empty but the manifest records {manifest.count} items: restore it "
                "from a backup or rebuild the index with dmlsearch build-index"
            )
        try:
            store = ItemStore(directory, manifest.dim)
        except sqlite3.DatabaseError as err:
            raise InvalidInputError(f"{items} cannot be read (truncated or corrupt?): {err}") from err
        index = None
        built = manifest.built
        if built.index_spec is not None and (directory / cls.FILE_NAME).exists():
            spec = IndexSpec.parse(built.index_type, built.index_spec, manifest.dim)
            try:
                index = FaissIndex.load(directory / cls.FILE_NAME, spec, mmap=mapped)
            except RuntimeError as err:  # faiss reports a short or garbled file as RuntimeError
                store.close()
                raise InvalidInputError(
                    f"{directory / cls.FILE_NAME} cannot be read (truncated or corrupt?): delete it and run "
                    f"dmlsearch build-index, which rebuilds it from items.sqlite ({err})"
                ) from err
            if built.search_params:
                index.set_search_params(built.search_params)
        backend = cls(directory, manifest, store, index)
        if index is not None and len(index) != len(store):
            backend._reconcile(index)
        return backend

    @property
    def capabilities(self) -> Capabilities:
        if self.index is None:
            return self.CAPABILITIES
        return replace(self.CAPABILITIES, tuning_parameter=tuning_parameter(self.index.spec))

    @property
    def items(self) -> ItemStore:
        return self.store

    @property
    def judgments(self) -> SqliteJudgments:
        return self.store.judgments

    @property
    def built(self) -> bool:
        return self.index is not None

    def built_index(self) -> BuiltIndex:
        return self._built

    def __len__(self) -> int:
        # The FAISS count is kept in step with the store (and is free; SQLite's COUNT(*) scans the table).
        return len(self.index) if self.index is not None else len(self.store)

    def add(
        self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes | None] | None = None
    ) -> list[int]:
        vectors = normalize_rows(vectors)
        ids = self.store.add(vectors, entries, signatures=signatures)
        if self.index is not None:
            self.index.add(np.asarray(ids, dtype=np.int64), vectors)
            self._dirty = True
        return ids

    def remove(self, ids: Sequence[int]) -> int:
        """Delete items (tombstones in an HNSW graph, rebuilt once they pass ``HNSW_MAX_REMOVED``)."""
        present = np.array(sorted(self.store.get_many(list(ids))), dtype=np.int64)
        removed = self.store.remove(present.tolist())
        if self.index is not None and len(present):
            self.index.remove(present)
            # Tombstones are not saved (open marks them again from the store): only other indexes change.
            self._dirty = self._dirty or self.index.spec.index_type is not IndexType.HNSW
            self._compact_graph(self.index)
        return removed

    def copy_in(
        self,
        vectors: np.ndarray,
        entries: Sequence[Entry],
        signatures: Sequence[bytes | None],
        *,
        added: Sequence[str],
        ids: Sequence[int] | None = None,
    ) -> list[int]:
        vectors = normalize_rows(vectors)
        new_ids = self.store.add(vectors, entries, added=added, ids=ids, signatures=signatures)
        if self.index is not None:
            self.index.add(np.asarray(new_ids, dtype=np.int64), vectors)
            self._dirty = True
        return new_ids

    def reserve_ids(self, last_id: int) -> None:
        self.store.reserve_ids(last_id)

    def last_id(self) -> int:
        return self.store.last_id()

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """From the item store, which keeps every vector exactly (whatever the FAISS index compresses)."""
        return self.store.vectors(np.asarray(ids, dtype=np.int64))

    def signatures(self, ids: Sequence[int] | None = None) -> dict[int, bytes]:
        return self.store.signatures(ids)

    def stats(self) -> dict[str, object]:
        return {"indexed_vectors": len(self.index) if self.index is not None else 0}

    def gallery_mark(self) -> str | None:
        return None  # its vectors live in its folder: no other process writes to them

    def record_gallery_mark(self, mark: str) -> None:
        raise CapabilityError("a FAISS index lives in its own folder: no gallery is shared through it")

    def move(self, moves: Sequence[Move]) -> int:
        """Metadata only: the vectors and the FAISS index are untouched."""
        return self.store.move(moves)

    def set_taken(self, taken: Mapping[int, str]) -> int:
        return self.store.set_taken(taken)

    def search(
        self, queries: np.ndarray, k: int, where: ItemFilter | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` ids and cosines; ``where`` restricts the items returned: SQLite resolves it to the ids
        it keeps (through the label, path and time indexes) and FAISS searches with an ``IDSelector`` of
        them, falling back to every inverted list when a very selective filter leaves the probed ones short.
        """
        if self.index is None and self.shard is not None:
            raise IndexNotBuiltError(
                f"{self.directory} is shard {self.shard} of a gallery: it stores vectors only; "
                "combine the shards with dmlsearch index merge, then search the merged index"
            )
        if self.index is None:
            raise IndexNotBuiltError(
                f"{self.directory} holds {len(self.store)} stored vectors but no search index yet "
                "(an interrupted build?): run dmlsearch build-index again to finish it"
            )
        if where is None or where.empty:
            return self.index.search(queries, k)
        return self.index.search(queries, k, self.store.matching_ids(where))

    def build(
        self,
        options: IndexOptions,
        *,
        retune: bool,
        partitions: Sequence[np.ndarray] | None = None,
        progress: bool = False,
    ) -> bool:
        """(Re)build when the index that ``options`` pick for the current size differs from the built one.

        Otherwise only re-tune the search parameters: when ``retune``, or when the item count has moved
        ``RETUNE_AFTER_CHANGE`` from the count they were tuned at. ``partitions``: ids per shard, built as
        separate parts and merged. Returns whether the index was rebuilt.
        """
        if len(self.store) == 0:
            raise InvalidInputError("cannot build a search index over an empty gallery")
        self.options = options
        spec = choose_index(len(self.store), self.dim, options)
        if self.index is None or self.index.spec != spec or partitions is not None:
            self._build(spec, partitions, progress=progress)
            return True
        if spec.index_type is IndexType.FLAT or not (
            retune or self._tuning_outdated()
        ):  # exact: nothing to tune
            return False
        if spec.index_type is IndexType.HNSW:
            # A graph is tuned while it is built (minutes at a million items): built again only once its
            # size has moved RETUNE_AFTER_CHANGE, or when its recall is below a target raised since.
            achieved = self._built.achieved_recall
            if not self._tuning_outdated() and achieved is not None and achieved >= options.target_recall:
                return False
            self._build(spec, progress=progress)
            return True
        target = options.target_recall
        self._record(
            retune_index(self.index, [StoreSource(self.store)], target_recall=target, progress=progress)
        )
        self._dirty = True  # the held-out vectors were removed and added again: write the index
        return False

    def _build(
        self, spec: IndexSpec, partitions: Sequence[np.ndarray] | None = None, *, progress: bool = False
    ) -> None:
        if partitions:
            sources = [StoreSource(self.store, ids) for ids in partitions]
        else:
            sources = [StoreSource(self.store)]
        self.index, tuning = build_faiss_index(
            spec, sources, target_recall=self.options.target_recall, progress=progress
        )
        self._built = BuiltIndex(index_type=spec.index_type, index_spec=spec.factory)
        self._record(tuning)
        self._dirty = True

    def _tuning_outdated(self) -> bool:
        tuned = self._built.tuned_count
        return tuned is None or abs(len(self.store) - tuned) >= RETUNE_AFTER_CHANGE * tuned

    def _record(self, tuning: Tuning) -> None:
        """Search parameters live in the manifest (applied at load): tuning alone rewrites no FAISS file."""
        self._built = self._built.model_copy(
            update={
                "search_params": dict(tuning.params),
                "achieved_recall": tuning.recall,
                "recall_queries": tuning.queries,
                "tuned_count": len(self.store),
            }
        )

    def _compact_graph(self, index: FaissIndex) -> None:
        if index.spec.index_type is IndexType.HNSW and index.removed_fraction > HNSW_MAX_REMOVED:
            log.info(
                "%.0f%% of the HNSW graph are removed items: rebuilding it from %d stored vectors",
                100 * index.removed_fraction,
                len(self.store),
            )
            self._build(index.spec)

    def _reconcile(self, index: FaissIndex) -> None:
        stored, indexed = self.store.ids(), index.ids()
        missing = np.setdiff1d(stored, indexed)
        extra = np.setdiff1d(indexed, stored)
        graph = index.spec.index_type is IndexType.HNSW
        if len(missing) or not graph:  # an HNSW graph's removed items are expected: its tombstones
            log.warning(
                "%s: FAISS index out of step with items.sqlite (an interrupted update): adding %d, "
                "removing %d",
                self.directory,
                len(missing),
                len(extra),
            )
        if len(extra):
            index.remove(extra)
        for ids, vectors in self.store.iter_vectors(65_536, missing):
            index.add(ids, vectors)
        self._dirty = bool(len(missing)) or (bool(len(extra)) and not graph)
        self._compact_graph(index)

    def save(self) -> None:
        if self.index is not None and self._dirty:
            self.index.save(self.directory / self.FILE_NAME)
            self._dirty = False

    def close(self) -> None:
        self.store.close()
