"""Near-duplicate groups are the connected components of a brute-force pair graph: by cosine alone on every
index type (items without perceptual signatures, FAISS and Milvus), and by cosine and signature bits."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from scipy.sparse.csgraph import connected_components

from engine.duplicates.groups import (
    DEFAULT_THRESHOLD,
    EMBEDDING_ONLY_THRESHOLD,
    Duplicates,
    SignatureTable,
    find_duplicates,
    group_pairs,
    signature_distance,
    signature_pairs,
)
from index.gallery import GalleryIndex
from index.items import ItemStore
from index.selection import IndexOptions
from tests.support.milvus_server import MILVUS_PARAMS, milvus_target
from tests.support.vectors import clustered_vectors, entries

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


def brute_force_groups(
    vectors: np.ndarray, ids: np.ndarray, linked: np.ndarray | None = None
) -> set[frozenset[int]]:
    """Components of the pairs with cosine >= THRESHOLD (and ``linked``, when given)."""
    similar = vectors @ vectors.T >= THRESHOLD
    if linked is not None:
        similar &= linked
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
    result = find_duplicates(index, THRESHOLD)
    assert result.unsigned == len(vectors) and "no perceptual signature" in result.note
    groups = result.groups
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


def planted_signatures(count: int, seed: int = 3) -> np.ndarray:
    """Random 4-view signatures (uint64), every fifth item a copy of the one before with a few bits flipped
    in one of its views, and one item whose mirror view is another's own view."""
    rng = np.random.default_rng(seed)
    signatures = rng.integers(0, 2**63, size=(count, 4), dtype=np.int64).view(np.uint64)
    for i in range(1, count, 5):
        signatures[i] = signatures[i - 1]
        flips = rng.choice(64, size=rng.integers(0, 7), replace=False)
        signatures[i, i % 4] ^= np.uint64(sum(1 << int(bit) for bit in flips))
    signatures[count - 1, 1] = signatures[0, 0]  # a mirrored copy: one's mirror view is the other itself
    return signatures


def brute_force_bits(signatures: np.ndarray) -> np.ndarray:
    """Every pair's signature distance, the slow way (all pairs, all views, loops)."""
    count = len(signatures)
    bits = np.zeros((count, count), dtype=np.int64)
    for a in range(count):
        for b in range(count):
            own = min(bin(int(signatures[a, 0] ^ view)).count("1") for view in signatures[b])
            other = min(bin(int(view ^ signatures[b, 0])).count("1") for view in signatures[a])
            bits[a, b] = min(own, other)
    return bits


@pytest.mark.parametrize("max_distance", [0, 3, 4, 6, 8, 11])
def test_signature_pairs_are_every_pair_within_the_distance(max_distance: int) -> None:
    signatures = planted_signatures(120)
    ids = np.arange(120, dtype=np.int64) * 3 + 5  # ids are not positions
    table = SignatureTable({int(i): row.tobytes() for i, row in zip(ids, signatures, strict=True)})
    firsts, seconds, bits = signature_pairs(table, max_distance)
    expected_bits = brute_force_bits(signatures)
    a, b = np.nonzero(np.triu(expected_bits <= max_distance, k=1))
    assert sorted(zip(firsts.tolist(), seconds.tolist(), bits.tolist(), strict=True)) == sorted(
        zip(ids[a].tolist(), ids[b].tolist(), expected_bits[a, b].tolist(), strict=True)
    )
    assert ((firsts < seconds) & (bits == signature_distance(signatures[a], signatures[b]))).all()


def test_signatures_stored_with_fewer_views_are_compared_on_the_views_all_have() -> None:
    """An index signed before views were added holds four-view signatures beside today's longer ones."""
    signatures = planted_signatures(60)
    longer = np.concatenate([signatures, signatures[:, :3] ^ np.uint64(0xFFFF)], axis=1)
    stored = {i: (longer[i] if i % 2 else signatures[i]).tobytes() for i in range(60)}
    table = SignatureTable(stored)
    assert table.rows.shape == (60, 4)
    np.testing.assert_array_equal(table.rows, signatures)
    firsts, seconds, bits = signature_pairs(table, 4)
    expected = SignatureTable({i: row.tobytes() for i, row in enumerate(signatures)})
    assert [x.tolist() for x in (firsts, seconds, bits)] == [x.tolist() for x in signature_pairs(expected, 4)]


def test_signed_items_pair_by_cosine_and_signature(tmp_path: Path) -> None:
    vectors = planted_vectors()[:500]
    signatures = planted_signatures(len(vectors))
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    ids = np.array(index.add(vectors, entries(len(vectors)), [row.tobytes() for row in signatures]))
    index.save()
    bits = brute_force_bits(signatures)
    result = find_duplicates(index, THRESHOLD, max_distance=4)
    assert result.unsigned == 0 and result.note is None and result.threshold == THRESHOLD
    found = {frozenset(group.ids.tolist()) for group in result.groups}
    assert found == brute_force_groups(vectors, ids, bits <= 4)
    assert find_duplicates(index).threshold == DEFAULT_THRESHOLD  # every item signed: the loose default
    index.close()


def test_an_index_from_before_signatures_still_opens_and_falls_back(tmp_path: Path) -> None:
    """An index written before the signatures table existed: it opens read-only and read-write, its items
    are judged by cosine alone at the stricter default, and items added later carry signatures."""
    vectors = planted_vectors()[:300]
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    index.add(vectors, entries(len(vectors)), [row.tobytes() for row in planted_signatures(300)])
    index.save()
    index.close()
    with sqlite3.connect(tmp_path / "index" / ItemStore.FILE_NAME) as old:
        old.execute("DROP TABLE signatures")  # what an index of an earlier version holds
    assert ItemStore(tmp_path / "index", DIM, read_only=True).signatures() == {}

    index = GalleryIndex.open(tmp_path / "index")
    result = find_duplicates(index)
    assert result.threshold == EMBEDDING_ONLY_THRESHOLD and result.unsigned == 300
    assert "300 of 300 items have no perceptual signature" in result.note
    new_ids = index.add(vectors[:2], entries(2, prefix="new"), [b"\x01" * 32, b"\x01" * 32])
    index.save()
    assert sorted(index.signatures()) == sorted(new_ids)
    assert find_duplicates(index).unsigned == 300
    index.close()


def test_no_pairs_no_groups_and_bad_thresholds(tmp_path: Path) -> None:
    assert group_pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)) == []
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    assert find_duplicates(index).groups == []  # an empty index
    index.add(clustered_vectors(50, DIM, spread=1.0), entries(50))
    index.save()
    assert find_duplicates(index, 0.999).groups == []
    with pytest.raises(ValueError, match="threshold"):
        find_duplicates(index, 1.5)
    with pytest.raises(ValueError, match="max_distance"):
        find_duplicates(index, max_distance=17)
    index.close()


@pytest.mark.parametrize("engine", MILVUS_PARAMS)
def test_milvus_indexes_are_grouped_through_the_index_protocol(
    engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Milvus keeps no signatures: its pairs come from its own kNN search, by cosine alone."""
    vectors = planted_vectors()[:400]
    target = milvus_target(engine, request, tmp_path / "index")
    index = GalleryIndex.create(
        tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None, **target
    )
    ids = np.array(index.add(vectors, entries(len(vectors)), [b"\x00" * 32] * len(vectors)))
    index.save()
    result = find_duplicates(index, THRESHOLD)
    index.close()
    assert result.unsigned == len(vectors) and result.note
    found = {frozenset(group.ids.tolist()) for group in result.groups}
    expected = brute_force_groups(vectors, ids)
    assert found and all(any(group <= truth for truth in expected) for group in found)


def test_the_criteria_name_signatures_only_where_items_have_them() -> None:
    def criteria(unsigned: int) -> str:
        return Duplicates(groups=[], threshold=0.9, max_distance=4, unsigned=unsigned, items=10).criteria

    assert criteria(0) == "cosine >= 0.9 with perceptual signatures within 4 bits"
    assert criteria(3) == "cosine >= 0.9, with perceptual signatures within 4 bits where both images have one"
    assert criteria(10) == "cosine >= 0.9 (no item has a perceptual signature: by cosine alone)"
