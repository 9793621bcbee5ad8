"""One FAISS index over L2-normalised vectors with int64 ids: inner product is the cosine similarity.

Loaded memory-mapped and read-only by default (IVF inverted lists through faiss.IO_FLAG_MMAP, flat codes
through faiss.IO_FLAG_MMAP_IFC), so a large index opens without reading it into RAM; the first change
re-reads it into memory, because faiss cannot modify a mapped index. Searches run on a GPU when
faiss-gpu and a GPU are present (not HNSW, which faiss cannot move to a GPU), on the CPU otherwise.

FAISS's HNSW graph cannot delete a node, so removing from one leaves a tombstone, as hnswlib's
``mark_deleted`` does: the node stays in the graph, where searches still walk through it, and a selector
keeps it out of every result. The tombstones live in memory only; the owner of the index knows which ids
it removed (the gallery's item store) and marks them again after loading, and rebuilds the graph once they
are a sizeable part of it.
"""

from __future__ import annotations

import logging
import math
import os
from functools import cache
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from foundation.atomic import atomic_path
from foundation.errors import DamagedFileError, InvalidInputError, MissingDependencyError
from foundation.families import IndexType
from foundation.regular_files import require_regular
from index.protocol import check_dim, normalize_rows
from index.selection import IndexSpec

log = logging.getLogger("dmlsearch.index")

# OPQ and PQ training, lighter than faiss's defaults, which took many minutes on 2 cores
# (docs/measurements.md).
OPQ_ITERATIONS = 10
OPQ_TRAIN_POINTS = 16_384
PQ_ITERATIONS = 15
PQ_POINTS_PER_CENTROID = 64
# faiss 1.15 finds nearest centroids pair by pair below distance_compute_blas_threshold vectors, far slower
# for PQ's 2-dimensional sub-vectors than matrix products: training takes the fast path at any size
# (docs/measurements.md).
TRAIN_BLAS_THRESHOLD = 20

# faiss ships no type information: its SWIG objects (indexes, selectors, search parameters) are untyped.
FaissObject: TypeAlias = Any


def faiss_module():
    # faiss's OpenMP threads spin while they wait for work: with more runnable threads than cores every
    # parallel region waits for descheduled spinners (docs/measurements.md). A default only: an
    # OMP_WAIT_POLICY set by the user wins. It must be set before faiss loads its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import faiss
    except ImportError as err:
        raise MissingDependencyError(
            "faiss is not installed: pip install 'dmlsearch[cpu]' (or 'dmlsearch[gpu]')"
        ) from err
    return faiss


@cache
def _gpu_resources() -> FaissObject | None:
    faiss = faiss_module()
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return None
    return faiss.StandardGpuResources()


class FaissIndex:
    def __init__(self, index: FaissObject, spec: IndexSpec, *, source: Path | None = None) -> None:
        if index.d != spec.dim:
            raise InvalidInputError(f"FAISS index has dimension {index.d}, expected {spec.dim}")
        self.index = index
        self.spec = spec
        self.search_params: dict[str, int] = {}
        self._source = source  # the file a memory-mapped (read-only) index was mapped from
        self._gpu_index: FaissObject | None = None  # the copy searched on the GPU, made at the first search
        self._gpu_refused = False  # the GPU could not take this index as it is: search on the CPU
        self._removed = np.zeros(0, dtype=np.int64)  # HNSW tombstones, sorted
        self._live: FaissObject | None = None  # HNSW: the selector that skips the tombstones, built once
        self._id_order: tuple[np.ndarray, np.ndarray] | None = None  # HNSW: sorted ids, their positions

    @classmethod
    def create(cls, spec: IndexSpec) -> FaissIndex:
        """An empty index; IVF and PQ indexes must be trained before vectors are added."""
        faiss = faiss_module()
        index = faiss.index_factory(spec.dim, spec.factory, faiss.METRIC_INNER_PRODUCT)
        if spec.opq:
            opq = faiss.downcast_VectorTransform(index.chain.at(0))
            opq.niter, opq.niter_pq_0, opq.max_train_points = OPQ_ITERATIONS, OPQ_ITERATIONS, OPQ_TRAIN_POINTS
        if spec.index_type is IndexType.IVFPQ:
            pq = faiss.downcast_index(faiss.extract_index_ivf(index)).pq
            pq.cp.niter, pq.cp.max_points_per_centroid = PQ_ITERATIONS, PQ_POINTS_PER_CENTROID
        return cls(index, spec)

    @property
    def dim(self) -> int:
        return self.spec.dim

    @property
    def is_trained(self) -> bool:
        return bool(self.index.is_trained)

    @property
    def read_only(self) -> bool:
        return self._source is not None

    def __len__(self) -> int:
        """The vectors searches can return (an HNSW graph's tombstones do not count)."""
        return int(self.index.ntotal) - len(self._removed)

    @property
    def removed_fraction(self) -> float:
        """The share of an HNSW graph's nodes that are tombstones (0 for every other index)."""
        return len(self._removed) / max(int(self.index.ntotal), 1)

    def train(self, vectors: np.ndarray) -> None:
        vectors = normalize_rows(vectors)
        check_dim(vectors, self.dim)
        cvar = faiss_module().cvar
        threshold, cvar.distance_compute_blas_threshold = (
            cvar.distance_compute_blas_threshold,
            TRAIN_BLAS_THRESHOLD,
        )
        try:
            self.index.train(vectors)
        finally:
            cvar.distance_compute_blas_threshold = threshold

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        vectors = normalize_rows(vectors)
        check_dim(vectors, self.dim)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(self._removed):
            # An HNSW tombstone added again: an item put back under its id (an undone duplicates apply), so
            # with its vector. Its node is still in the graph and only counts again: a second node under
            # the same id would make searches find it twice.
            back = np.isin(ids, self._removed)
            if back.any():
                self._removed = np.setdiff1d(self._removed, ids[back])
                self._live = None
                ids, vectors = ids[~back], vectors[~back]
        if not len(ids):
            return
        self._make_writable()
        self.index.add_with_ids(vectors, ids)
        self._id_order = None

    def remove(self, ids: np.ndarray) -> int:
        """Remove ``ids``; returns how many were in the index. An HNSW graph marks them as tombstones."""
        if self.spec.index_type is IndexType.HNSW:
            present = np.intersect1d(ids, self.ids())
            self._removed = np.union1d(self._removed, present)
            self._live = None
            return len(present)
        self._make_writable()
        return int(self.index.remove_ids(np.ascontiguousarray(ids, dtype=np.int64)))

    def search(
        self,
        queries: np.ndarray,
        k: int,
        allowed: np.ndarray | None = None,
        *,
        exhaustive_when_short: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` ``(ids, cosine scores)``; rows are padded with id -1 and score -inf.

        ``allowed``: only these ids may be returned (a filter), through a FAISS ``IDSelectorBatch`` in
        the per-call search parameters, with the tuned nprobe / efSearch. Rows that come back with fewer
        than ``min(k, len(self))`` results (``len(allowed)`` with a filter: the probed IVF lists or the
        HNSW beam did not reach that many) are searched again exhaustively, unless not
        ``exhaustive_when_short`` (tuning counts what the probes reach itself).
        """
        queries = normalize_rows(queries)
        check_dim(queries, self.dim, "queries")
        if allowed is not None and self._scan_beats_graph(len(allowed), k):
            return self._subset_search(queries, k, np.asarray(allowed, dtype=np.int64))
        selector, widen, reachable = None, 1.0, len(self)
        if allowed is not None:
            selector = faiss_module().IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
            widen = len(self) / max(len(allowed), 1)
            reachable = min(len(self), len(allowed))
        elif len(self._removed):
            selector = self._not_removed()
        if selector is None:
            scores, ids = self._searcher().search(queries, k)
        else:
            params = self._params(selector, exhaustive=False, widen=widen)
            scores, ids = self._search_numpy(queries, k, params)
        short = (ids >= 0).sum(axis=1) < min(k, reachable)
        if exhaustive_when_short and short.any():
            scores[short], ids[short] = self._exhaustive_search(queries[short], k, selector)
        scores[ids < 0] = -np.inf
        return ids, scores

    def _scan_beats_graph(self, allowed: int, k: int) -> bool:
        """Whether a filter keeps so few items of an HNSW graph that scanning them beats walking the graph.

        A walk that may only return a share ``allowed / len`` of the nodes meets about ``len / allowed``
        nodes per result, each costing M distances; the scan costs ``allowed`` distances. (IVF widens its
        probes instead: see ``_params``.)
        """
        m = self.spec.hnsw_m
        return m is not None and allowed * allowed <= m * k * len(self)

    def _subset_search(
        self, queries: np.ndarray, k: int, allowed: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` over ``allowed`` alone, scanning their vectors as the graph stores them."""
        faiss = faiss_module()
        positions, present = self._positions(allowed)
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        if len(present):
            stored = self._graph_storage().reconstruct_batch(positions)
            found_scores, found = faiss.knn(
                queries, stored, min(k, len(present)), metric=faiss.METRIC_INNER_PRODUCT
            )
            width = found.shape[1]
            ids[:, :width] = np.where(found >= 0, present[found], -1)
            scores[:, :width] = np.where(found >= 0, found_scores, -np.inf)
        return ids, scores

    def _positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions in an HNSW graph's storage of those of ``ids`` it holds (tombstones excluded), and
        those ids; through a sorted copy of the id map, made once per change."""
        if self._id_order is None:
            id_map = faiss_module().vector_to_array(self.index.id_map).astype(np.int64)
            order = np.argsort(id_map, kind="stable")
            self._id_order = (id_map[order], order)
        sorted_ids, order = self._id_order
        where = np.minimum(np.searchsorted(sorted_ids, ids), max(len(sorted_ids) - 1, 0))
        held = (sorted_ids[where] == ids) if len(sorted_ids) else np.zeros(len(ids), dtype=bool)
        if len(self._removed):
            held &= ~np.isin(ids, self._removed)
        return order[where[held]], ids[held]

    def _graph_storage(self) -> FaissObject:
        """An HNSW graph's vectors, by position: a flat index (float32 or, by default, fp16 codes)."""
        faiss = faiss_module()
        return faiss.downcast_index(faiss.downcast_index(self.index.index).storage)

    def _search_numpy(
        self, queries: np.ndarray, k: int, params: FaissObject
    ) -> tuple[np.ndarray, np.ndarray]:
        # faiss.contrib.torch_utils (imported by pytorch-metric-learning, for one) replaces ``search`` with a
        # version that takes no ``params`` and keeps faiss's own as ``search_numpy``.
        search = getattr(self.index, "search_numpy", self.index.search)
        return search(queries, k, params=params)

    def _exhaustive_search(
        self, queries: np.ndarray, k: int, selector: FaissObject | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        faiss = faiss_module()
        if self.spec.index_type is IndexType.HNSW:  # brute force over the graph's storage
            storage = self._graph_storage()
            id_map = faiss.vector_to_array(self.index.id_map)
            params = None
            if selector is not None:  # the storage knows positions: the id map translates them for it
                translated = faiss.IDSelectorTranslated(self.index.id_map, selector)
                params = faiss.SearchParameters()
                params.sel = translated  # the local name keeps it alive through the search
            scores, positions = storage.search(queries, k, params=params)
            return scores, np.where(positions >= 0, id_map[positions], -1)
        return self._search_numpy(queries, k, self._params(selector, exhaustive=True))

    def _params(self, selector: FaissObject | None, *, exhaustive: bool, widen: float = 1.0) -> FaissObject:
        """Per-call faiss search parameters (thread-safe, unlike setting nprobe on the index): the tuned
        ones, or every inverted list when ``exhaustive``; restricted to ``selector``'s ids when given.

        ``widen``: how many items there are per item a filter keeps. An IVF search then probes that many
        times more lists (at most all), so that it meets about as many candidates as an unfiltered search
        at the tuned nprobe: a 1% filter probes 100x the lists, instead of coming back short and scanning
        every list.
        """
        faiss = faiss_module()
        tuned = self.search_params
        if self.spec.index_type is IndexType.FLAT:
            params = faiss.SearchParameters()
        elif self.spec.index_type is IndexType.HNSW:
            params = faiss.SearchParametersHNSW()
            params.efSearch = tuned.get("efSearch", params.efSearch)
        else:
            assert self.spec.nlist is not None  # every other family is an IVF index, with lists
            params = faiss.SearchParametersIVF()
            probes = self.spec.nlist if exhaustive else math.ceil(tuned.get("nprobe", params.nprobe) * widen)
            params.nprobe = min(probes, self.spec.nlist)
            if self.spec.hnsw_quantizer:
                params.quantizer_params = faiss.SearchParametersHNSW()
                params.quantizer_params.efSearch = (
                    self.spec.nlist
                    if exhaustive
                    else max(tuned.get("quantizer_efSearch", self.spec.nlist), params.nprobe)
                )
        if selector is not None:
            params.sel = selector
        if not self.spec.opq:
            return params
        wrapped = faiss.SearchParametersPreTransform()  # the OPQ rotation wraps the IVF index
        wrapped.index_params = params
        return wrapped

    def _not_removed(self) -> FaissObject:
        """A selector of every id but the tombstones: a bitmap up to the largest one (one bit an id, a
        lookup per candidate, cheaper than hashing when a search meets thousands of nodes)."""
        if self._live is None:
            faiss = faiss_module()
            bits = np.zeros(int(self._removed[-1]) + 1, dtype=bool)
            bits[self._removed] = True
            # faiss's Python wrappers keep the bitmap and the inner selector alive with the outer one.
            self._live = faiss.IDSelectorNot(faiss.IDSelectorBitmap(np.packbits(bits, bitorder="little")))
        return self._live

    def set_search_params(self, params: dict[str, int]) -> None:
        """Apply ``nprobe`` / ``efSearch`` / ``quantizer_efSearch`` through faiss's ParameterSpace."""
        space = faiss_module().ParameterSpace()
        for name, value in params.items():
            space.set_index_parameter(self.index, name, value)
        self.search_params = dict(params)
        self._forget_gpu_copy()

    def ids(self) -> np.ndarray:
        """Every id in the index (not an HNSW graph's tombstones), sorted."""
        faiss = faiss_module()
        ivf = faiss.try_extract_index_ivf(self.index)
        if ivf is None:
            stored = np.sort(faiss.vector_to_array(self.index.id_map).astype(np.int64))
            return np.setdiff1d(stored, self._removed, assume_unique=True) if len(self._removed) else stored
        lists = ivf.invlists
        chunks = []
        for list_no in range(lists.nlist):
            size = lists.list_size(list_no)
            if size:
                pointer = lists.get_ids(list_no)
                chunks.append(faiss.rev_swig_ptr(pointer, size).copy())
                lists.release_ids(list_no, pointer)
        return np.sort(np.concatenate(chunks)) if chunks else np.zeros(0, dtype=np.int64)

    def empty_copy(self) -> FaissIndex:
        """A copy with the same training (centroids, codebooks) and no vectors."""
        faiss = faiss_module()
        copy = faiss.clone_index(self.index)
        copy.reset()
        return FaissIndex(copy, self.spec)

    def merge_from(self, other: FaissIndex) -> None:
        """Move ``other``'s vectors into this index (same training); faiss's own IVF / IDMap merge."""
        if self.spec.index_type is IndexType.HNSW:
            raise InvalidInputError(
                "faiss cannot merge HNSW graphs; build one graph from all vectors instead"
            )
        self._make_writable()
        if self.spec.index_type is IndexType.FLAT:
            self.index.merge_from(other.index)
        else:
            faiss_module().merge_into(self.index, other.index, False)

    def save(self, path: Path) -> None:
        faiss = faiss_module()
        with atomic_path(path) as temporary:
            try:
                faiss.write_index(self.index, str(temporary))
            except RuntimeError as err:  # faiss reports a full disk or a failed write as RuntimeError
                raise OSError(f"could not write {path.name}: {err}") from err

    @classmethod
    def load(cls, path: Path, spec: IndexSpec, *, mmap: bool = True) -> FaissIndex:
        faiss = faiss_module()
        require_regular(path)  # faiss would wait on a FIFO for ever
        # IVF lists map as read-only OnDiskInvertedLists; flat codes (flat, an HNSW graph's vectors) as views.
        flag = faiss.IO_FLAG_MMAP if spec.nlist is not None else faiss.IO_FLAG_MMAP_IFC
        try:
            index = faiss.read_index(str(path), flag) if mmap else faiss.read_index(str(path))
        except RuntimeError as err:  # faiss's message names neither the file nor what is wrong with it
            raise DamagedFileError(f"{path} is damaged or truncated ({str(err).splitlines()[-1]})") from err
        return cls(index, spec, source=path if mmap else None)

    def _make_writable(self) -> None:
        """faiss aborts the process on changes to a mapped index: re-read it into memory first."""
        if self._source is not None:
            params = self.search_params
            self.index = faiss_module().read_index(str(self._source))
            self._source = None
            if params:
                self.set_search_params(params)
        self._forget_gpu_copy()

    def _forget_gpu_copy(self) -> None:
        """The index changed: a GPU copy is stale, and the GPU may take it now."""
        self._gpu_index = None
        self._gpu_refused = False

    def _searcher(self) -> FaissObject:
        resources = _gpu_resources()
        if resources is None or self.spec.index_type is IndexType.HNSW or self._gpu_refused:
            return self.index
        if self._gpu_index is None:
            faiss = faiss_module()
            try:
                self._gpu_index = faiss.index_cpu_to_gpu(resources, 0, self.index)
                for name, value in self.search_params.items():
                    faiss.GpuParameterSpace().set_index_parameter(self._gpu_index, name, value)
                log.info("searching %s on the GPU", self.spec.factory)
            except RuntimeError as err:  # e.g. a PQ code size or nprobe faiss's GPU kernels do not support
                log.warning("searching %s on the CPU: the GPU cannot take it (%s)", self.spec.factory, err)
                self._gpu_refused = True
                return self.index
        return self._gpu_index
