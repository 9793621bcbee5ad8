"""One FAISS index over L2-normalised vectors with int64 ids: inner product is the cosine similarity.

Loaded memory-mapped and read-only by default (IVF inverted lists through faiss.IO_FLAG_MMAP, flat codes
through faiss.IO_FLAG_MMAP_IFC), so a large index opens without reading it into RAM; the first change
re-reads it into memory, because faiss cannot modify a mapped index. Searches run on a GPU when
faiss-gpu and a GPU are present (not HNSW, which faiss cannot move to a GPU), on the CPU otherwise.
"""

from __future__ import annotations

import logging
import math
import os
from functools import cache
from pathlib import Path

import numpy as np

from index.atomic import atomic_path
from index.protocol import check_dim, normalize_rows
from index.selection import IndexSpec

log = logging.getLogger("dmlsearch.index")

# OPQ and PQ training, lighter than faiss's defaults (50 OPQ iterations on 65,536 vectors; 25 k-means
# iterations on 256 points per centroid), which took many minutes on 2 cores: OPQ on 128 codes took 432 s
# for 20k vectors with the defaults here.
OPQ_ITERATIONS = 10
OPQ_TRAIN_POINTS = 16_384
PQ_ITERATIONS = 15
PQ_POINTS_PER_CENTROID = 64
# faiss 1.15 finds nearest centroids pair by pair for fewer than distance_compute_blas_threshold (128,000)
# vectors, and by matrix products or a fused kernel above that. For the 2-dimensional sub-vectors of PQ
# codebooks the pairwise loop is ~50x slower: k-means of 60,000 points to 1,024 centroids took 0.43 s an
# iteration against 0.005 s here, so training switches to the fast path at any size.
TRAIN_BLAS_THRESHOLD = 20


class RemovalNotSupportedError(RuntimeError):
    """FAISS's HNSW graph cannot delete vectors in place; the graph must be rebuilt without them."""


def faiss_module():
    # faiss's OpenMP threads spin while they wait for work. With more runnable threads than cores (a
    # shared 2-core machine) every parallel region then waits for descheduled spinners: OPQ training took
    # 92 s with the default policy and 0.7 s with passive waiting in one measurement here. A default only:
    # an OMP_WAIT_POLICY set by the user wins. It must be set before faiss loads its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "faiss is not installed: pip install 'dmlsearch[cpu]' (or 'dmlsearch[gpu]')"
        ) from err
    return faiss


@cache
def _gpu_resources() -> object | None:
    faiss = faiss_module()
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return None
    return faiss.StandardGpuResources()


class FaissIndex:
    def __init__(self, index: object, spec: IndexSpec, *, source: Path | None = None) -> None:
        if index.d != spec.dim:
            raise ValueError(f"FAISS index has dimension {index.d}, expected {spec.dim}")
        self.index = index
        self.spec = spec
        self.search_params: dict[str, int] = {}
        self._source = source  # the file a memory-mapped (read-only) index was mapped from
        self._gpu_index: object | bool | None = None  # the GPU copy; False once the GPU refused it

    @classmethod
    def create(cls, spec: IndexSpec) -> FaissIndex:
        """An empty index; IVF and PQ indexes must be trained before vectors are added."""
        faiss = faiss_module()
        index = faiss.index_factory(spec.dim, spec.factory, faiss.METRIC_INNER_PRODUCT)
        if spec.opq:
            opq = faiss.downcast_VectorTransform(index.chain.at(0))
            opq.niter, opq.niter_pq_0, opq.max_train_points = OPQ_ITERATIONS, OPQ_ITERATIONS, OPQ_TRAIN_POINTS
        if spec.index_type == "ivfpq":
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
        return int(self.index.ntotal)

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
        self._make_writable()
        self.index.add_with_ids(vectors, np.ascontiguousarray(ids, dtype=np.int64))

    def remove(self, ids: np.ndarray) -> int:
        if self.spec.index_type == "hnsw":
            raise RemovalNotSupportedError(
                "an HNSW index cannot remove vectors in place; it has to be rebuilt without them"
            )
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
        selector = None
        if allowed is None:
            scores, ids = self._searcher().search(queries, k)
            reachable = len(self)
        else:
            selector = faiss_module().IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
            widen = len(self) / max(len(allowed), 1)
            scores, ids = self._search_numpy(
                queries, k, self._params(selector, exhaustive=False, widen=widen)
            )
            reachable = min(len(self), len(allowed))
        short = (ids >= 0).sum(axis=1) < min(k, reachable)
        if exhaustive_when_short and short.any():
            scores[short], ids[short] = self._exhaustive_search(queries[short], k, selector, allowed)
        scores[ids < 0] = -np.inf
        return ids, scores

    def _search_numpy(self, queries: np.ndarray, k: int, params: object) -> tuple[np.ndarray, np.ndarray]:
        # faiss.contrib.torch_utils (imported by pytorch-metric-learning, for one) replaces ``search`` with a
        # version that takes no ``params`` and keeps faiss's own as ``search_numpy``.
        search = getattr(self.index, "search_numpy", self.index.search)
        return search(queries, k, params=params)

    def _exhaustive_search(
        self, queries: np.ndarray, k: int, selector: object | None = None, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        faiss = faiss_module()
        if self.spec.index_type == "hnsw":  # brute force over the graph's flat storage
            storage = faiss.downcast_index(faiss.downcast_index(self.index.index).storage)
            id_map = faiss.vector_to_array(self.index.id_map)
            params = None
            if allowed is not None:  # the storage knows positions, not ids
                params = faiss.SearchParameters()
                params.sel = faiss.IDSelectorBatch(np.flatnonzero(np.isin(id_map, allowed)).astype(np.int64))
            scores, positions = storage.search(queries, k, params=params)
            return scores, np.where(positions >= 0, id_map[positions], -1)
        return self._search_numpy(queries, k, self._params(selector, exhaustive=True))

    def _params(self, selector: object | None, *, exhaustive: bool, widen: float = 1.0) -> object:
        """Per-call faiss search parameters (thread-safe, unlike setting nprobe on the index): the tuned
        ones, or every inverted list when ``exhaustive``; restricted to ``selector``'s ids when given.

        ``widen``: how many items there are per item a filter keeps. An IVF search then probes that many
        times more lists (at most all), so that it meets about as many candidates as an unfiltered search
        at the tuned nprobe: a 1% filter probes 100x the lists, instead of coming back short and scanning
        every list.
        """
        faiss = faiss_module()
        tuned = self.search_params
        if self.spec.index_type == "flat":
            params = faiss.SearchParameters()
        elif self.spec.index_type == "hnsw":
            params = faiss.SearchParametersHNSW()
            params.efSearch = tuned.get("efSearch", params.efSearch)
        else:
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

    def set_search_params(self, params: dict[str, int]) -> None:
        """Apply ``nprobe`` / ``efSearch`` / ``quantizer_efSearch`` through faiss's ParameterSpace."""
        space = faiss_module().ParameterSpace()
        for name, value in params.items():
            space.set_index_parameter(self.index, name, value)
        self.search_params = dict(params)
        self._gpu_index = None

    def ids(self) -> np.ndarray:
        """Every id in the index, sorted."""
        faiss = faiss_module()
        ivf = faiss.try_extract_index_ivf(self.index)
        if ivf is None:
            return np.sort(faiss.vector_to_array(self.index.id_map).astype(np.int64))
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
        if self.spec.index_type == "hnsw":
            raise ValueError("faiss cannot merge HNSW graphs; build one graph from all vectors instead")
        self._make_writable()
        if self.spec.index_type == "flat":
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
        # IVF lists map as read-only OnDiskInvertedLists; flat codes (flat, HNSW storage) as views.
        flag = faiss.IO_FLAG_MMAP if spec.nlist is not None else faiss.IO_FLAG_MMAP_IFC
        try:
            index = faiss.read_index(str(path), flag) if mmap else faiss.read_index(str(path))
        except RuntimeError as err:  # faiss's message names neither the file nor what is wrong with it
            raise RuntimeError(f"{path} is damaged or truncated ({str(err).splitlines()[-1]})") from err
        return cls(index, spec, source=path if mmap else None)

    def _make_writable(self) -> None:
        """faiss aborts the process on changes to a mapped index: re-read it into memory first."""
        if self._source is not None:
            params = self.search_params
            self.index = faiss_module().read_index(str(self._source))
            self._source = None
            if params:
                self.set_search_params(params)
        self._gpu_index = None

    def _searcher(self) -> object:
        resources = _gpu_resources()
        if resources is None or self.spec.index_type == "hnsw" or self._gpu_index is False:
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
                self._gpu_index = False
                return self.index
        return self._gpu_index
