"""Tune a FAISS index's search parameters (nprobe, efSearch) to reach a target recall@k.

Recall is measured against exact search on held-out queries: a seeded sample of the stored vectors,
each searched leave-one-out (its own id is dropped from both the exact and the approximate results),
which is what a new query from the same distribution sees. The smallest parameter that reaches the
target wins; when no value reaches it (product quantisation saturates), the smallest value within
``PLATEAU`` of the best recall seen is kept and the shortfall is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from index.faiss_index import FaissIndex, faiss_module
from index.sources import VectorSource, all_ids, fetch_vectors

RECALL_K = 10
TUNING_QUERIES = 1000
PLATEAU = 0.002
EXACT_CHUNK = 65_536


@dataclass(frozen=True)
class Tuning:
    params: dict[str, int] = field(default_factory=dict)
    recall: float = 1.0  # recall@k measured with these params (1.0 for exact search: nothing to measure)
    target: float = 1.0
    queries: int = 0
    k: int = RECALL_K

    @property
    def met(self) -> bool:
        return self.recall >= self.target


def sample_ids(ids: np.ndarray, count: int, seed: int) -> np.ndarray:
    """A seeded, sorted sample of ``count`` of ``ids`` (all of them when there are fewer)."""
    if count >= len(ids):
        return np.sort(ids)
    chosen = np.random.default_rng(seed).choice(len(ids), size=count, replace=False)
    return np.sort(np.sort(ids)[chosen])


def exact_neighbours(queries: np.ndarray, sources: Sequence[VectorSource], k: int) -> np.ndarray:
    """Ids of the exact top-``k`` inner products, streaming the sources in chunks (faiss ResultHeap)."""
    faiss = faiss_module()
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for source in sources:
        for ids, vectors in source.iter_vectors(EXACT_CHUNK):
            scores, positions = faiss.knn(queries, vectors, min(k, len(ids)), metric=faiss.METRIC_INNER_PRODUCT)
            heap.add_result(scores, ids[positions])
    heap.finalize()
    return heap.I


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each row of ``truth`` (n, k) that appears in the same row of ``found``."""
    k = truth.shape[1]
    return float(np.mean([len(set(f.tolist()) & set(t.tolist())) / k for f, t in zip(found, truth, strict=True)]))


def _drop_self(ids: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    return np.stack([row[row != me][:k] for row, me in zip(ids, own, strict=True)])


def _ladder(low: int, high: int) -> list[int]:
    values, value = [], max(low, 1)
    while value < high:
        values.append(value)
        value *= 2
    return [*values, high]


def _parameters(index: FaissIndex, k: int) -> tuple[list[int], Callable[[int], dict[str, int]]] | None:
    spec = index.spec
    if spec.index_type == "hnsw":
        return _ladder(max(16, k), 4096), lambda ef: {"efSearch": ef}
    if spec.nlist is None:
        return None
    if spec.hnsw_quantizer:
        return _ladder(1, spec.nlist), lambda n: {"nprobe": n, "quantizer_efSearch": max(16, 2 * n)}
    return _ladder(1, spec.nlist), lambda n: {"nprobe": n}


def tune(
    index: FaissIndex,
    sources: Sequence[VectorSource],
    target_recall: float,
    *,
    k: int = RECALL_K,
    max_queries: int = TUNING_QUERIES,
    seed: int = 1,
    progress: bool = False,
) -> Tuning:
    """Set and return the cheapest search parameters that reach ``target_recall`` at recall@``k``."""
    parameters = _parameters(index, k)
    ids = all_ids(sources)
    k = min(k, len(ids) - 1)
    if parameters is None or k < 1:  # exact search, or too few vectors to miss any neighbour
        return Tuning(target=target_recall, k=max(k, 0))
    values, to_params = parameters
    query_ids = sample_ids(ids, max_queries, seed)
    queries = fetch_vectors(sources, query_ids, index.dim)
    truth = _drop_self(exact_neighbours(queries, sources, k + 1), query_ids, k)
    measured: dict[int, float] = {}

    def recall(value: int) -> float:
        if value not in measured:
            index.set_search_params(to_params(value))
            found, _ = index.search(queries, k + 1)
            measured[value] = recall_at_k(_drop_self(found, query_ids, k), truth)
        return measured[value]

    bar = tqdm(desc=f"tuning {next(iter(to_params(1)))}", unit="try", disable=not progress)
    passing, failing = None, None
    for value in values:
        bar.update()
        if recall(value) >= target_recall:
            passing = value
            break
        if failing is not None and recall(value) - recall(failing) < PLATEAU / 2:
            break  # more probing no longer helps: a quantisation ceiling
        failing = value
    if passing is not None and failing is not None:
        while passing - failing > 1:  # bisect between the last failing and the first passing value
            bar.update()
            middle = (passing + failing) // 2
            passing, failing = (middle, failing) if recall(middle) >= target_recall else (passing, middle)
    bar.close()
    if passing is None:
        best = max(measured.values())
        passing = min(value for value, r in measured.items() if r >= best - PLATEAU)
    index.set_search_params(to_params(passing))
    return Tuning(to_params(passing), recall(passing), target_recall, len(query_ids), k)
