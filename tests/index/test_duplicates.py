"""Near-duplicate groups are the connected components of a brute-force pair graph, on every index type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.sparse.csgraph import connected_components

from index.duplicates import DuplicatesUnavailableError, find_duplicates, group_pairs
from index.gallery import GalleryIndex
from index.selection import IndexOptions
from tests.helpers import clustered_vectors, entries

DIM = 32
THRESHOLD = 0.95


def planted_vectors() -> np.ndarray:
    """2,000 clustered vectors plus copies: pairs, triples, and a chain of 30 (only neighbours close)."""
    rng = np.random.default_rng(7)
    base = clustered_vectors(2000, DIM, clusters=40, spread=0.4)
    copies = [base[i] + 0.05 * rng.standard_normal((1 + i % 3, DIM)) for i in range(0, 300, 10)]
    step = rng.standard_normal(DIM) * 0.04
    chain = base[1000] + np.cumsum(np.tile(step, (30, 1)) + 0.01 * rng.standard_normal((30, DIM)), axis=0)
    vectors = np.concatenate([base, *copies, chain]).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def brute_force_groups(vectors: np.ndarray, ids: np.ndarray) -> set[frozenset[int]]:
    similar = vectors @ vectors.T >= THRESHOLD
    np.fill_diagonal(similar, False)
    _, component = connected_components(similar, directed=False)
    sizes = np.bincount(component)
    return {frozenset(ids[component == c].tolist()) for c in np.flatnonzero(sizes > 1)}


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf", "ivfsq", "ivfpq"])
def test_groups_equal_brute_force_components(index_type: str, tmp_path: Path) -> None:
    vectors = planted_vectors()
    index = GalleryIndex.create(
        tmp_path / "index",
        dim=DIM,
        model_fingerprint="m",
        gallery_root=None,
        options=IndexOptions(index_type),
    )
    ids = np.array(index.add(vectors, entries(len(vectors))))
    index.save()
    expected = brute_force_groups(vectors, ids)
    assert any(len(group) == 31 for group in expected)  # the chain with its origin: longer than 16 neighbours
    groups = find_duplicates(index, THRESHOLD)
    found = {frozenset(group.ids.tolist()) for group in groups}
    index.close()
    if index_type == "flat":
        assert found == expected
    else:  # approximate search may miss a link of the chain (within its tuned recall), never add one
        assert all(any(group <= truth for truth in expected) for group in found)
        pairs = lambda groups: sum(len(g) * (len(g) - 1) // 2 for g in groups)  # noqa: E731
        assert pairs(found) >= 0.9 * pairs(expected)
    assert [len(g.ids) for g in groups] == sorted((len(g.ids) for g in groups), reverse=True)
    for group in groups:  # each member's best score is a true cosine to another member, >= the threshold
        members = vectors[np.searchsorted(ids, group.ids)]
        cosines = members @ members.T
        np.fill_diagonal(cosines, -1)
        np.testing.assert_allclose(group.scores, cosines.max(axis=1), atol=1e-5)
        assert (group.scores >= THRESHOLD).all()


def test_no_pairs_no_groups_and_bad_thresholds(tmp_path: Path) -> None:
    assert group_pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)) == []
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    index.add(clustered_vectors(50, DIM, spread=1.0), entries(50))
    index.save()
    assert find_duplicates(index, 0.999) == []
    with pytest.raises(ValueError, match="threshold"):
        find_duplicates(index, 1.5)
    index.close()


def test_milvus_indexes_are_refused_clearly(tmp_path: Path) -> None:
    pytest.importorskip("pymilvus")
    pytest.importorskip("milvus_lite")
    index = GalleryIndex.create(
        tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None, backend="milvus"
    )
    index.add(clustered_vectors(20, DIM), entries(20))
    with pytest.raises(DuplicatesUnavailableError, match="FAISS"):
        find_duplicates(index, THRESHOLD)
    index.close()
