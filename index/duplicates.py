"""Near-duplicate groups: connected components of the graph of item pairs with cosine >= a threshold.

Candidate pairs come from the index's own k-nearest-neighbour search of every stored vector (IVF and HNSW
make that far cheaper than all pairs, and nothing is compared pair by pair in Python); scores of
quantised indexes (SQ8, PQ) are re-computed exactly from the stored vectors before the threshold cuts.
``scipy.sparse.csgraph`` finds the components. A group larger than ``neighbours + 1`` is still found
whole as long as its members are chained by close pairs, which near-duplicates are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

if TYPE_CHECKING:  # the CLI imports this module for its defaults: keep that import light
    from index.gallery import GalleryIndex
    from index.items import ItemStore

# Chosen by bench/duplicates.py (Cars196 test photos plus re-encoded, resized, 90%-cropped, mirrored and
# +-15% brightness copies of 400 of them): the threshold with the best min(pair precision, pair recall) on
# one half of the copies. With the pretrained model that is 0.91, where the other half measures precision
# 0.88 and recall 0.80: both short of 0.95 (bench/results/duplicates.md; half-size copies are the misses).
DEFAULT_THRESHOLD = 0.91
DEFAULT_NEIGHBOURS = 16  # candidates per item from the kNN search
# Quantised scores are approximate: candidates this far below the threshold are re-scored exactly too.
QUANTISED_MARGIN = 0.05
EXACT_INDEX_TYPES = frozenset({"flat", "hnsw", "ivf"})  # their scores are exact inner products
_CHUNK = 4096  # query vectors per search call


class DuplicatesUnavailableError(ValueError):
    """The index cannot give back its stored vectors (Milvus), which finding duplicates reads."""


@dataclass(frozen=True)
class DuplicateGroup:
    ids: np.ndarray  # member ids, ascending
    scores: np.ndarray  # each member's highest cosine to another member of the group


def _stored_vectors(index: GalleryIndex) -> ItemStore:
    from index.items import ItemStore

    store = index.items
    if not isinstance(store, ItemStore):
        raise DuplicatesUnavailableError(
            f"finding duplicates reads every stored vector, which this {index.manifest.backend} index does "
            "not give back: use a FAISS index"
        )
    return store


def duplicate_pairs(
    index: GalleryIndex, threshold: float, *, neighbours: int = DEFAULT_NEIGHBOURS, progress: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first ids, second ids, cosines)`` of the distinct pairs with cosine >= ``threshold`` among each
    item's ``neighbours`` nearest neighbours (first id < second id)."""
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a cosine in [-1, 1], got {threshold}")
    if neighbours < 1:
        raise ValueError(f"neighbours must be at least 1, got {neighbours}")
    store = _stored_vectors(index)
    exact = index.manifest.index_type in EXACT_INDEX_TYPES
    cut = threshold if exact else threshold - QUANTISED_MARGIN
    firsts, seconds, cosines = [], [], []
    total = len(index)
    chunks: Iterator[tuple[np.ndarray, np.ndarray]] = store.iter_vectors(_CHUNK)
    with tqdm(total=total, desc="duplicates", unit="item", disable=not progress) as bar:
        for ids, vectors in chunks:
            found, scores = index.backend.search(vectors, min(neighbours + 1, total))
            rows, columns = np.nonzero((scores >= cut) & (found > ids[:, None]))  # each pair once
            first, second, score = ids[rows], found[rows, columns], scores[rows, columns]
            if not exact and len(second):
                score = np.einsum("ij,ij->i", vectors[rows], store.vectors(second))
                keep = score >= threshold
                first, second, score = first[keep], second[keep], score[keep]
            firsts.append(first)
            seconds.append(second)
            cosines.append(np.clip(score, -1.0, 1.0))
            bar.update(len(ids))
    if not firsts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.float32)
    return np.concatenate(firsts), np.concatenate(seconds), np.concatenate(cosines).astype(np.float32)


def group_pairs(firsts: np.ndarray, seconds: np.ndarray, scores: np.ndarray) -> list[DuplicateGroup]:
    """Connected components of the pair graph, largest first (then by smallest id)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    if len(firsts) == 0:
        return []
    ids, positions = np.unique(np.concatenate([firsts, seconds]), return_inverse=True)
    a, b = positions[: len(firsts)], positions[len(firsts) :]
    graph = coo_matrix((np.ones(len(a), dtype=np.int8), (a, b)), shape=(len(ids), len(ids)))
    _, component = connected_components(graph, directed=False)
    best = np.full(len(ids), -np.inf, dtype=np.float32)
    np.maximum.at(best, a, scores)
    np.maximum.at(best, b, scores)
    order = np.argsort(component, kind="stable")  # ids ascending within each component
    starts = np.flatnonzero(np.diff(component[order], prepend=-1))
    groups = [
        DuplicateGroup(ids[members], best[members]) for members in np.split(order, starts[1:]) if len(members)
    ]
    return sorted(groups, key=lambda group: (-len(group.ids), int(group.ids[0])))


def find_duplicates(
    index: GalleryIndex,
    threshold: float = DEFAULT_THRESHOLD,
    *,
    neighbours: int = DEFAULT_NEIGHBOURS,
    progress: bool = False,
) -> list[DuplicateGroup]:
    """Groups of near-duplicate items: items joined by chains of pairs with cosine >= ``threshold``."""
    return group_pairs(*duplicate_pairs(index, threshold, neighbours=neighbours, progress=progress))
