"""Retrieval and clustering metrics of the deep-metric-learning papers, on L2-normalised embeddings.

* Recall@K: the share of queries with at least one same-class item among their K nearest neighbours
  (every item is a query; the gallery is all other items; cosine similarity).
* MAP@R (Musgrave et al., "A Metric Learning Reality Check", 2020): for a query with R other items of its
  class, the mean over its first R neighbours of precision@i at each relevant rank i.
* NMI and F1 of k-means with as many clusters as classes: sklearn's normalised mutual information and the
  pairwise F-measure (precision and recall over item pairs put in the same cluster) of the lifted-structure
  paper's clustering protocol.

* Neighbourhood agreement (label-free runs' gate, training.label_free_data): how many of a photo's k nearest
  photos a changed view of it still has among its k nearest.

Queries whose class has no other item cannot be answered and are left out of Recall@K and MAP@R.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import faiss
import numpy as np
from sklearn.metrics import normalized_mutual_info_score
from sklearn.metrics.cluster import pair_confusion_matrix

from foundation.errors import InvalidInputError

DEFAULT_KS = (1, 2, 4, 8)


def _unit(embeddings: np.ndarray) -> np.ndarray:
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def nearest_neighbours(embeddings: np.ndarray, k: int) -> np.ndarray:
    """Indices (n, k) of each item's k most cosine-similar *other* items, best first (exact search)."""
    vectors = _unit(embeddings)
    k = min(k, len(vectors) - 1)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    _, found = index.search(vectors, k + 1)
    # Drop the query itself; where ties push it out of the first k + 1, drop the last neighbour instead.
    is_self = found == np.arange(len(vectors))[:, None]
    is_self[~is_self.any(axis=1), -1] = True
    return found[~is_self].reshape(len(vectors), k)


def neighbourhood_agreement(folder: np.ndarray, held: np.ndarray, views: np.ndarray, k: int) -> np.ndarray:
    """Per held-out photo (rows ``held`` of the ``folder``'s embeddings, its photos as served): the share of
    its ``k`` nearest photos of the folder (cosine, exact) that its view (``views``, a row per held photo)
    also has among its ``k`` nearest, its own photo left out of both."""
    k = min(k, len(folder) - 1)
    index = faiss.IndexFlatIP(folder.shape[1])
    index.add(_unit(folder))

    def nearest(queries: np.ndarray) -> np.ndarray:
        _, found = index.search(_unit(queries), k + 1)
        # Leave the photo itself out; where ties push it past the first k + 1, the last one instead.
        is_self = found == held[:, None]
        is_self[~is_self.any(axis=1), -1] = True
        return found[~is_self].reshape(len(held), k)

    around, view_around = nearest(folder[held]), nearest(views)
    shared = [len(np.intersect1d(a, b)) for a, b in zip(around, view_around, strict=True)]
    return np.array(shared, dtype=np.float64) / k


def answerable(labels: np.ndarray) -> np.ndarray:
    """Which items can be queries: their class has at least one other item."""
    _, inverse, counts = np.unique(np.asarray(labels), return_inverse=True, return_counts=True)
    return counts[inverse] > 1


@dataclass(frozen=True)
class TopHits:
    """Per answerable query (``queries`` index the embedded rows): its nearest other item and whether
    that item shares its class (the query's Recall@1)."""

    queries: np.ndarray
    top1: np.ndarray
    hit: np.ndarray


def top_hits(embeddings: np.ndarray, labels: np.ndarray) -> TopHits:
    queries = np.flatnonzero(answerable(labels))
    top1 = nearest_neighbours(embeddings, 1)[queries, 0]
    return TopHits(queries, top1, labels[top1] == labels[queries])


def retrieval_metrics(
    embeddings: np.ndarray, labels: np.ndarray, ks: Sequence[int] = DEFAULT_KS
) -> dict[str, float]:
    """``recall@K`` for each K and ``map@r``, as fractions in [0, 1]."""
    labels = np.asarray(labels)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    relevant_count = counts[inverse] - 1  # R per query
    answerable = relevant_count > 0
    if not answerable.any():
        raise InvalidInputError("no class has two items: retrieval metrics are undefined")
    depth = max(max(ks), int(relevant_count.max()))
    neighbours = nearest_neighbours(embeddings, depth)
    hits = labels[neighbours] == labels[:, None]  # (n, depth)
    hits, relevant_count = hits[answerable], relevant_count[answerable]

    results = {f"recall@{k}": float(hits[:, :k].any(axis=1).mean()) for k in ks}
    ranks = np.arange(1, hits.shape[1] + 1)
    within_r = ranks[None, :] <= relevant_count[:, None]
    relevant = hits & within_r
    precision_at_i = np.cumsum(relevant, axis=1) / ranks[None, :]
    results["map@r"] = float(((precision_at_i * relevant).sum(axis=1) / relevant_count).mean())
    return results


def clustering_metrics(embeddings: np.ndarray, labels: np.ndarray, *, seed: int = 0) -> dict[str, float]:
    """``nmi`` and ``f1`` of faiss k-means (cosine: on unit vectors) with one cluster per class."""
    vectors = _unit(embeddings)
    labels = np.asarray(labels)
    num_classes = len(np.unique(labels))
    kmeans = faiss.Kmeans(vectors.shape[1], num_classes, niter=50, nredo=5, seed=seed, spherical=True)
    # Several restarts, best objective kept: one random start often merges two classes.
    # faiss warns (and subsamples) below 39 points per centroid; the papers cluster all points.
    kmeans.cp.min_points_per_centroid = 1
    kmeans.cp.max_points_per_centroid = max(256, len(vectors))
    kmeans.train(vectors)
    _, assigned = kmeans.index.search(vectors, 1)
    predicted = assigned[:, 0]
    pairs = pair_confusion_matrix(labels, predicted).astype(np.float64)  # [[TN, FP], [FN, TP]]
    true_positive = pairs[1, 1]
    precision = true_positive / max(true_positive + pairs[0, 1], 1.0)
    recall = true_positive / max(true_positive + pairs[1, 0], 1.0)
    f1 = 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)
    return {"nmi": float(normalized_mutual_info_score(labels, predicted)), "f1": float(f1)}


def evaluate(
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    ks: Sequence[int] = DEFAULT_KS,
    clustering: bool = True,
    seed: int = 0,
) -> dict[str, float]:
    """All metrics of the papers' protocol on one split (query = each item, gallery = the others)."""
    results = retrieval_metrics(embeddings, labels, ks)
    if clustering:
        results.update(clustering_metrics(embeddings, labels, seed=seed))
    return results
