"""Build a FAISS index from stored vectors: train once, fill one part per source, merge, tune.

With several sources (the shards of a gallery) each source fills its own copy of the trained empty index
and the parts are merged with faiss's own IVF / IDMap merge, the recipe faiss documents for building
large indexes in pieces. Training and tuning samples are drawn from the union of ids with fixed seeds,
so one source or the same vectors split over shards give the same index.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from index.faiss_index import FaissIndex
from index.selection import PQ_CENTROIDS, IndexSpec
from index.sources import VectorSource, all_ids, fetch_vectors
from index.tuning import Tuning, sample_ids, tune

TRAIN_POINTS_PER_LIST = 50  # faiss warns below 39; autofaiss uses 30-256
TRAIN_POINTS_PQ = 64 * PQ_CENTROIDS  # enough for OPQ and 8-bit PQ codebooks
ADD_CHUNK = 65_536
TRAIN_SEED = 0


def training_size(spec: IndexSpec, count: int) -> int:
    if spec.nlist is None:
        return 0
    needed = spec.nlist * TRAIN_POINTS_PER_LIST
    if spec.index_type == "ivfpq":
        needed = max(needed, TRAIN_POINTS_PQ)
    return min(count, needed)


def _fill(index: FaissIndex, source: VectorSource, bar: tqdm) -> None:
    for ids, vectors in source.iter_vectors(ADD_CHUNK):
        index.add(ids, vectors)
        bar.update(len(ids))


def build_faiss_index(
    spec: IndexSpec, sources: Sequence[VectorSource], *, target_recall: float, progress: bool = False
) -> tuple[FaissIndex, Tuning]:
    """Train ``spec`` on a sample of all sources, add every vector, and tune its search parameters."""
    ids = all_ids(sources)
    index = FaissIndex.create(spec)
    if not index.is_trained:
        train_ids = sample_ids(ids, training_size(spec, len(ids)), TRAIN_SEED)
        if progress:
            tqdm.write(f"training {spec.factory} on {len(train_ids)} vectors")
        index.train(fetch_vectors(sources, train_ids, spec.dim))
    with tqdm(total=len(ids), desc=f"adding to {spec.index_type}", unit="vec", disable=not progress) as bar:
        if len(sources) == 1 or spec.index_type == "hnsw":  # faiss cannot merge HNSW graphs
            for source in sources:
                _fill(index, source, bar)
        else:
            for source in sources:
                part = index.empty_copy()
                _fill(part, source, bar)
                index.merge_from(part)
    tuning = tune(index, sources, target_recall, progress=progress)
    return index, tuning
