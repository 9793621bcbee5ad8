"""Build a FAISS index from stored vectors: train once, fill one part per source, merge, tune.

With several sources (the shards of a gallery) each source fills its own copy of the trained empty index
and the parts are merged with faiss's own IVF / IDMap merge, the recipe faiss documents for building
large indexes in pieces. Training and tuning samples are drawn from the union of ids with fixed seeds,
so one source or the same vectors split over shards give the same index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from foundation.families import IndexType
from foundation.progress import progress_bar
from index.faiss_index import PQ_POINTS_PER_CENTROID, FaissIndex
from index.selection import PQ_BITS, IndexSpec
from index.sources import ExcludingSource, VectorSource, all_ids, fetch_vectors
from index.tuning import Tuning, graph_set_aside, held_out_ids, needs_tuning, sample_ids, tune

TRAIN_POINTS_PER_LIST = 50  # faiss warns below 39; autofaiss uses 30-256
ADD_CHUNK = 65_536
TRAIN_SEED = 0


def training_size(spec: IndexSpec, count: int) -> int:
    if spec.nlist is None:
        return 0
    needed = spec.nlist * TRAIN_POINTS_PER_LIST
    if spec.index_type is IndexType.IVFPQ:
        needed = max(needed, PQ_POINTS_PER_CENTROID * 2 ** (spec.pq_bits or PQ_BITS))  # what PQ trains on
    return min(count, needed)


def _fill(index: FaissIndex, source: VectorSource, bar: tqdm) -> None:
    for ids, vectors in source.iter_vectors(ADD_CHUNK):
        index.add(ids, vectors)
        bar.update(len(ids))


def tuning_set_aside(
    spec: IndexSpec, sources: Sequence[VectorSource], ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The tuning queries' vectors, and the ids kept out of the index until it is tuned: the queries, and
    for an HNSW graph their neighbourhoods too (index/tuning.py)."""
    graph = spec.index_type is IndexType.HNSW
    held_out = held_out_ids(ids, graph=graph)
    queries = fetch_vectors(sources, held_out, spec.dim)
    if not graph or not len(held_out):
        return queries, held_out
    others = [ExcludingSource(source, held_out) for source in sources]
    return queries, np.union1d(held_out, graph_set_aside(queries, others, len(ids)))


def build_faiss_index(
    spec: IndexSpec, sources: Sequence[VectorSource], *, target_recall: float, progress: bool = False
) -> tuple[FaissIndex, Tuning]:
    """Train ``spec`` on a sample of all sources, add every vector, and tune its search parameters.

    The tuning queries (and, in an HNSW graph, their neighbourhoods) are held out of the index until
    tuning is done, then added like the rest.
    """
    ids = all_ids(sources)
    index = FaissIndex.create(spec)
    if not index.is_trained:
        train_ids = sample_ids(ids, training_size(spec, len(ids)), TRAIN_SEED)
        if progress:
            tqdm.write(f"training {spec.factory} on {len(train_ids)} vectors")
        index.train(fetch_vectors(sources, train_ids, spec.dim))
    if needs_tuning(index):
        queries, aside = tuning_set_aside(spec, sources, ids)
    else:
        queries, aside = np.zeros((0, spec.dim), dtype=np.float32), np.zeros(0, dtype=np.int64)
    rest = [ExcludingSource(source, aside) for source in sources]
    with progress_bar(
        total=len(ids), desc=f"adding to {spec.index_type}", unit="vec", disable=not progress
    ) as bar:
        if len(rest) == 1 or spec.index_type is IndexType.HNSW:  # faiss cannot merge HNSW graphs
            for source in rest:
                _fill(index, source, bar)
        else:
            for source in rest:
                part = index.empty_copy()
                _fill(part, source, bar)
                index.merge_from(part)
        tuning = tune(index, queries, rest, target_recall, progress=progress)
        index.add(aside, fetch_vectors(sources, aside, spec.dim))
        bar.update(len(aside))
    return index, tuning


def retune(
    index: FaissIndex, sources: Sequence[VectorSource], *, target_recall: float, progress: bool = False
) -> Tuning:
    """Re-tune a built index that can remove vectors: hold the queries out, tune, put them back."""
    held_out = held_out_ids(all_ids(sources)) if needs_tuning(index) else np.zeros(0, dtype=np.int64)
    queries = fetch_vectors(sources, held_out, index.dim)
    index.remove(held_out)
    tuning = tune(
        index, queries, [ExcludingSource(s, held_out) for s in sources], target_recall, progress=progress
    )
    index.add(held_out, queries)
    return tuning
