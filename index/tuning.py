"""Tune a FAISS index's search parameters (nprobe, efSearch) to reach a target recall@k.

Recall is measured against exact search on held-out queries: a seeded sample of the gallery's own
vectors that is *not in the index* while it is measured (the builder adds them afterwards). Searching
with vectors that are in the index would flatter an HNSW graph, whose nodes start out next to their
neighbours.

Nor may the held-out queries keep near copies in the index: a gallery that holds several shots of the
same thing (bursts, crops, the augmented views of bench/index_bench.py's real rows) hands a held-out shot
its siblings as its top-k, which its own IVF cell or graph neighbourhood holds, and tuning on such queries
settles on a search that finds a new photo's neighbours poorly (in tests/index/test_faiss.py's groups of
8 copies, tuned to 0.9: recall@10 0.65 on new photos with IVF). So each query's ``NEIGHBOURHOOD`` nearest
gallery vectors are set aside, as for a query with no copy in the gallery. An IVF index searches for
``k + NEIGHBOURHOOD`` and recall is that of the query's next ``k`` neighbours: its cells hold what they
hold whatever else is in them. An HNSW graph is built without the neighbourhoods (``graph_set_aside``)
until it is tuned, because a graph walk depends on the nodes around the query: searched past them
instead, a graph leads from the query's copies straight to its next neighbours, and on groups of near
copies such as the test's, tuning then settles on a beam too narrow for new photos.

Both ask for more than new photos need, the price of a target that holds for new and known queries
alike. bench/hnsw_tuning.py draws the proxies against new images on bench/index_bench.py's calibrated
vectors (bench/results/hnsw_tuning.md): no held-out proxy tracks new images at every efSearch.

The smallest parameter reaching the target wins; when none does (product quantisation
saturates), the smallest value within ``PLATEAU`` of the best recall seen is kept and the shortfall
is reported in the result.

The ladder also stops once a search takes more than ``MAX_QUERY_MS`` a query: an index that slow is no
use for interactive search whatever its recall, and on vectors without structure (uniform random) the
ladder would otherwise climb to an all but exhaustive scan, which for the slowest codes (10-bit PQ) at a
million vectors means hours of tuning. Small galleries never come near it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from foundation.families import IndexType
from foundation.progress import progress_bar
from index.faiss_index import FaissIndex, faiss_module
from index.selection import IndexSpec
from index.sources import VectorSource

RECALL_K = 10
TUNING_QUERIES = 1000
HELD_OUT_FRACTION = 10  # at most one vector in ten is held out, for small galleries
PLATEAU = 0.002
EXACT_CHUNK = 65_536
QUERY_SEED = 1
MAX_QUERY_MS = 20.0
# Nearest gallery vectors set aside per query: a group of near copies (a burst, the 13 views per image of
# bench/index_bench.py's real rows) and a few more. Not many more: a new photo still finds the other photos
# of its kind in the gallery, and setting those aside too asks for still more than new photos need. IVF
# tuned to 0.95 this way gave new images at least the recall asked for, and with none set aside well below
# it (bench/results/index_bench_real.md, index_bench_1m_calibrated.md, index_bench_real_neighbourhood0.md).
NEIGHBOURHOOD = 16
# An HNSW graph leaves out at most a quarter of the gallery while it is tuned: fewer queries, down to
# MIN_GRAPH_QUERIES, so that each keeps its whole neighbourhood; below that, smaller neighbourhoods.
GRAPH_SET_ASIDE_SHARE = 4
MIN_GRAPH_QUERIES = 20


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


def held_out_ids(ids: np.ndarray, *, graph: bool = False) -> np.ndarray:
    """The ids whose vectors serve as tuning queries: up to 1000, at most a tenth of the gallery; for an
    HNSW ``graph``, few enough that their neighbourhoods fit in ``graph_set_aside``'s share."""
    count = min(TUNING_QUERIES, len(ids) // HELD_OUT_FRACTION)
    if graph:
        fitting = len(ids) // (GRAPH_SET_ASIDE_SHARE * (NEIGHBOURHOOD + 1))
        count = min(count, max(fitting, MIN_GRAPH_QUERIES))
    return sample_ids(ids, count, QUERY_SEED)


def needs_tuning(index: FaissIndex) -> bool:
    return index.spec.index_type is not IndexType.FLAT


def exact_neighbours(queries: np.ndarray, sources: Sequence[VectorSource], k: int) -> np.ndarray:
    """Ids of the exact top-``k`` inner products, streaming the sources in chunks (faiss ResultHeap)."""
    faiss = faiss_module()
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for source in sources:
        for ids, vectors in source.iter_vectors(EXACT_CHUNK):
            scores, positions = faiss.knn(
                queries, vectors, min(k, len(ids)), metric=faiss.METRIC_INNER_PRODUCT
            )
            heap.add_result(scores, np.where(positions >= 0, ids[positions], -1))
    heap.finalize()
    return heap.I


def graph_set_aside(queries: np.ndarray, sources: Sequence[VectorSource], count: int) -> np.ndarray:
    """The ids an HNSW graph of ``count`` vectors leaves out while it is tuned: each query's nearest
    ``NEIGHBOURHOOD`` vectors in ``sources`` (fewer where that would be over a quarter of a small gallery)."""
    per_query = min(NEIGHBOURHOOD, count // (GRAPH_SET_ASIDE_SHARE * max(len(queries), 1)))
    if per_query == 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(exact_neighbours(queries, sources, per_query))


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each row of ``truth`` (n, k) that appears in the same row of ``found``."""
    k = truth.shape[1]
    hits = [len(set(f.tolist()) & set(t.tolist())) for f, t in zip(found, truth, strict=True)]
    return float(np.mean(hits)) / k


def outside(found: np.ndarray, neighbourhoods: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` ids of each row of ``found`` that are not in the same row of ``neighbourhoods``."""
    inside = (found[:, :, None] == neighbourhoods[:, None, :]).any(axis=2)
    order = np.argsort(inside, axis=1, kind="stable")[:, :k]  # the ids outside first, in their order
    return np.take_along_axis(np.where(inside, -1, found), order, axis=1)


def _ladder(low: int, high: int) -> list[int]:
    values, value = [], max(low, 1)
    while value < high:
        values.append(value)
        value *= 2
    return [*values, high]


def tuning_parameter(spec: IndexSpec) -> str | None:
    """The search-time knob tuning turns for ``spec``'s index (None: exact search, nothing to tune)."""
    if spec.index_type is IndexType.FLAT:
        return None
    return "efSearch" if spec.index_type is IndexType.HNSW else "nprobe"


def _parameters(index: FaissIndex, k: int) -> tuple[list[int], Callable[[int], dict[str, int]]]:
    spec = index.spec
    if spec.index_type is IndexType.HNSW:
        return _ladder(max(16, k), 4096), lambda ef: {"efSearch": ef}
    assert spec.nlist is not None  # a flat index needs no tuning: the others are IVF indexes, with lists
    if spec.hnsw_quantizer:
        return _ladder(1, spec.nlist), lambda n: {"nprobe": n, "quantizer_efSearch": max(16, 2 * n)}
    return _ladder(1, spec.nlist), lambda n: {"nprobe": n}


def tune(
    index: FaissIndex,
    queries: np.ndarray,
    sources: Sequence[VectorSource],
    target_recall: float,
    *,
    k: int = RECALL_K,
    progress: bool = False,
) -> Tuning:
    """Set and return the cheapest search parameters reaching ``target_recall`` at recall@``k``.

    ``queries`` must not be in ``index`` (nor, for HNSW, their ``graph_set_aside``); ``sources`` hold
    exactly the vectors that are.
    """
    k = min(k, len(index))
    if not needs_tuning(index) or k < 1 or len(queries) == 0:
        return Tuning(target=target_recall, k=max(k, 0))
    values, to_params = _parameters(index, k)
    # IVF only: an HNSW graph is built without the neighbourhoods (graph_set_aside).
    aside = min(NEIGHBOURHOOD, len(index) - k) if index.spec.nlist is not None else 0
    ranked = exact_neighbours(queries, sources, k + aside)
    neighbourhoods, truth = ranked[:, :aside], ranked[:, aside:]
    measured: dict[int, float] = {}
    query_ms: dict[int, float] = {}

    def recall(value: int) -> float:
        if value not in measured:
            index.set_search_params(to_params(value))
            began = time.perf_counter()
            # What the probes reach, with no exhaustive repeat of short rows: searching k + aside comes back
            # short at probe counts where a search for k would not, and repeating those rows would make
            # the fewest probes look exact.
            found = index.search(queries, k + aside, exhaustive_when_short=False)[0]
            found = outside(found, neighbourhoods, k)
            query_ms[value] = (time.perf_counter() - began) * 1000.0 / len(queries)
            measured[value] = recall_at_k(found, truth)
        return measured[value]

    bar = progress_bar(desc=f"tuning {next(iter(to_params(1)))}", unit="try", disable=not progress)
    passing, failing = None, None
    for value in values:
        bar.update()
        if recall(value) >= target_recall:
            passing = value
            break
        if failing is not None and recall(value) - recall(failing) < PLATEAU / 2:
            break  # more probing no longer helps: a quantisation ceiling
        if query_ms[value] > MAX_QUERY_MS:
            break  # too slow to serve already: searching more only gets slower
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
    return Tuning(to_params(passing), recall(passing), target_recall, len(queries), k)
