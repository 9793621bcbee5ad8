"""Near-duplicate groups: connected components of the graph of pairs of items that are copies of one image.

The embedding alone cannot tell a copy of a photo from another photo of the same thing: it is trained for
category similarity, and on Cars196 two photos of one car model embed as close as a photo and its
half-size copy. So a pair is two items whose perceptual signatures (bit strings the engine computes from
each image: ``engine.duplicates.signature``) are within ``max_distance`` bits and whose cosine is >= a loose
``threshold`` as well.

- Every item signed (the normal case): the pairs within ``max_distance`` bits are found exactly by a
  FAISS multi-hash range search over the signatures (``IndexBinaryMultiHash``: with more hash tables than
  ``max_distance``, any two codes that close agree on one table's bits), and their cosines are computed
  from the stored vectors.
- Some items without a signature (indexed before signatures were stored; Milvus keeps none): candidate
  pairs come from one batched k-nearest-neighbour search of every stored vector through the index itself
  (IVF and HNSW make that far cheaper than all pairs), cut at ``threshold``, which then defaults to a
  stricter value; pairs of two signed items must still be within ``max_distance`` bits, the others are
  judged by cosine alone, and the result says how many items that concerns. Scores of indexes that
  search through codes (SQ8, PQ, a graph's fp16 vectors) are re-computed exactly from the stored vectors
  before the threshold cuts.

Nothing is compared pair by pair in Python. ``scipy.sparse.csgraph`` finds the components.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from engine.duplicates.signature_layout import (
    THUMBNAIL_SIDE,
    UPRIGHT_VIEWS,
    VIEW_BITS,
    thumbnail_of,
    views_of,
)
from foundation.errors import InvalidInputError
from foundation.progress import progress_bar
from index.faiss_index import faiss_module
from index.selection import IndexSpec

if TYPE_CHECKING:  # the CLI imports this module for its defaults: keep that import light
    from index.gallery import GalleryIndex
    from index.manifest import Manifest

# Chosen by bench/duplicates.py on one half of its copies (Cars196 test photos plus re-encoded, half-size,
# 90%-cropped, mirrored and +-15% brightness copies of 400 of them) and measured on the other half:
# bench/results/duplicates.md.
DEFAULT_THRESHOLD = 0.75  # candidate cosine, for items with signatures: loose, the signatures decide
DEFAULT_MAX_DISTANCE = 4  # signature bits (of 64) that two copies of one photo may differ by
EMBEDDING_ONLY_THRESHOLD = 0.91  # default cosine when some items have no signature (best min(P, R))
DEFAULT_NEIGHBOURS = 16  # candidates per item from the kNN search (items without signatures)
MAX_DISTANCE_LIMIT = 16  # more bits than this would put most items in every hash bucket
# Quantised scores are approximate: candidates this far below the threshold are re-scored exactly too.
QUANTISED_MARGIN = 0.05
MILVUS_QUANTISED = frozenset({"IVF_SQ8", "IVF_PQ"})  # Milvus's index types that score through codes
_CHUNK = 4096  # query vectors per search call


@dataclass(frozen=True)
class DuplicateGroup:
    ids: np.ndarray  # member ids, ascending
    scores: np.ndarray  # each member's highest cosine to another member of the group


@dataclass(frozen=True)
class Duplicates:
    groups: list[DuplicateGroup]  # largest first
    threshold: float  # the cosine cut used
    max_distance: int
    unsigned: int  # items without a perceptual signature: their pairs were judged by cosine alone
    items: int

    @property
    def criteria(self) -> str:
        """How pairs were judged, in words: signatures are named only where items have them."""
        cosine = f"cosine >= {self.threshold}"
        if self.unsigned == 0:
            return f"{cosine} with perceptual signatures within {self.max_distance} bits"
        if self.unsigned >= self.items:
            return f"{cosine} (no item has a perceptual signature: by cosine alone)"
        return (
            f"{cosine}, with perceptual signatures within {self.max_distance} bits where both images have one"
        )

    @property
    def note(self) -> str | None:
        """Why some pairs were judged by the embedding alone, and what to do about it; None if none were."""
        if self.unsigned == 0:
            return None
        return (
            f"{self.unsigned} of {self.items} items have no perceptual signature (indexed before signatures "
            "were stored, or in a Milvus index): pairs with them are judged by cosine alone, which cannot "
            "tell a copy from another photo of the same thing as well. To check every pair by image, "
            "re-embed a FAISS index with its own model: dmlsearch index rebuild INDEX --model "
            "INDEX/model.onnx --out NEW"
        )


def check_threshold(threshold: float) -> None:
    if not -1.0 <= threshold <= 1.0:
        raise InvalidInputError(f"threshold must be a cosine in [-1, 1], got {threshold}")


def check_max_distance(max_distance: int) -> None:
    if not 0 <= max_distance <= MAX_DISTANCE_LIMIT:
        raise InvalidInputError(f"max_distance must be in [0, {MAX_DISTANCE_LIMIT}] bits, got {max_distance}")


def signature_distance(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Bits between rows of two signature arrays (uint64, one column per view, the image itself first):
    the fewest over the image's own view against any view of the other, and the reverse."""
    return signature_match(first, second)[0]


def signature_match(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`signature_distance`, and where its fewest bits are reached only through a turned view: one
    image is the other turned by a quarter or a half (signatures without turned views: never)."""
    own = np.bitwise_count(first[:, :1] ^ second)
    other = np.bitwise_count(first ^ second[:, :1])
    bits = np.minimum(own.min(axis=1), other.min(axis=1)).astype(np.int64)
    upright = np.minimum(own[:, :UPRIGHT_VIEWS].min(axis=1), other[:, :UPRIGHT_VIEWS].min(axis=1))
    return bits, bits < upright


def _all_vectors(index: GalleryIndex) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, vectors)`` chunks of every item: one cursor over a FAISS index's store, else through the
    protocol (Milvus: item ids, then their stored vectors)."""
    from index.items import ItemStore

    store = index.items
    if isinstance(store, ItemStore):
        yield from store.iter_vectors(_CHUNK)
        return
    ids = np.fromiter((item.id for item in store.scan()), dtype=np.int64)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        yield chunk, index.vectors(chunk.tolist())


def _exact_scores(manifest: Manifest) -> bool:
    """Whether the gallery's index scores with the stored vectors themselves (not through codes)."""
    built = manifest.built
    if built.index_spec is not None:  # FAISS: its index_factory string says
        return IndexSpec.parse(built.index_type, built.index_spec, manifest.dim).exact_scores
    return built.index_type not in MILVUS_QUANTISED


def candidate_pairs(
    index: GalleryIndex, threshold: float, *, neighbours: int = DEFAULT_NEIGHBOURS, progress: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first ids, second ids, cosines)`` of the distinct pairs with cosine >= ``threshold`` among each
    item's ``neighbours`` nearest neighbours (first id < second id)."""
    check_threshold(threshold)
    if neighbours < 1:
        raise InvalidInputError(f"neighbours must be at least 1, got {neighbours}")
    total = len(index)
    exact = _exact_scores(index.manifest)
    cut = threshold if exact else threshold - QUANTISED_MARGIN
    firsts, seconds, cosines = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.float32)]
    with progress_bar(total=total, desc="duplicates", unit="item", disable=not progress) as bar:
        for ids, vectors in _all_vectors(index):
            found, scores = index.nearest(vectors, min(neighbours + 1, total))
            rows, columns = np.nonzero((scores >= cut) & (found > ids[:, None]))  # each pair once
            first, second, score = ids[rows], found[rows, columns], scores[rows, columns]
            if not exact and len(second):
                score = np.einsum("ij,ij->i", vectors[rows], index.vectors(second.tolist()))
                keep = score >= threshold
                first, second, score = first[keep], second[keep], score[keep]
            firsts.append(first)
            seconds.append(second)
            cosines.append(np.clip(score, -1.0, 1.0))
            bar.update(len(ids))
    return np.concatenate(firsts), np.concatenate(seconds), np.concatenate(cosines).astype(np.float32)


class SignatureTable:
    """Every stored signature's views as a uint64 array (one row per signed item, ids ascending), and the
    aligned thumbnails of those that carry one (``engine.duplicates.signature_layout``)."""

    def __init__(self, stored: dict[int, bytes]) -> None:
        self.ids = np.array(sorted(stored), dtype=np.int64)
        views_stored = [views_of(stored[int(i)]) for i in self.ids]
        # Signatures stored before views were added are the first views of today's: compare the views all
        # items have.
        shortest = min((len(blob) for blob in views_stored), default=VIEW_BITS // 8)
        views = shortest * 8 // VIEW_BITS
        self.rows = np.frombuffer(
            b"".join(blob[:shortest] for blob in views_stored), dtype=np.uint64
        ).reshape(len(views_stored), views)
        self._stored = stored
        self.has_thumbnail = np.array(
            [thumbnail_of(stored[int(i)]) is not None for i in self.ids], dtype=bool
        )
        self._thumbnail_rows = np.cumsum(self.has_thumbnail) - 1  # signed row -> thumbnail row

    @cached_property
    def thumbnails(self) -> np.ndarray:
        """``(items with one, side, side)`` uint8, in id order: copied only when the aligned check runs."""
        found = [thumbnail_of(self._stored[int(i)]) for i in self.ids[self.has_thumbnail]]
        thumbnails = [thumbnail for thumbnail in found if thumbnail is not None]  # all, by has_thumbnail
        empty = np.zeros((0, THUMBNAIL_SIDE, THUMBNAIL_SIDE), dtype=np.uint8)
        return np.stack(thumbnails) if thumbnails else empty

    def __len__(self) -> int:
        return len(self.ids)

    def _positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(signed, positions)``: whether each id has a signature, and each id's place in ``self.ids``
        (meaningful where signed)."""
        positions = np.minimum(np.searchsorted(self.ids, ids), max(len(self.ids) - 1, 0))
        signed = self.ids[positions] == ids if len(self.ids) else np.zeros(len(ids), dtype=bool)
        return signed, positions

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(signed, rows)``: whether each id has a signature, and the row of those that have one."""
        signed, positions = self._positions(ids)
        return signed, self.rows[positions[signed]]

    def with_thumbnail(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id has a signature with a thumbnail (no thumbnail is copied)."""
        signed, positions = self._positions(ids)
        signed[signed] &= self.has_thumbnail[positions[signed]]
        return signed

    def thumbnails_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(with_thumbnail, thumbnails)``: whether each id has a signature with a thumbnail, and the
        thumbnails of those that have one."""
        found = self.with_thumbnail(ids)
        _, positions = self._positions(ids[found])
        return found, self.thumbnails[self._thumbnail_rows[positions]]


def verify_pairs(
    firsts: np.ndarray,
    seconds: np.ndarray,
    cosines: np.ndarray,
    signatures: SignatureTable,
    *,
    threshold: float,
    max_distance: int,
) -> np.ndarray:
    """Which candidate pairs are duplicates: those with cosine >= ``threshold`` whose signatures are within
    ``max_distance`` bits, or where either item has no signature, by the cosine alone."""
    first_signed, first_rows = signatures.lookup(firsts)
    second_signed, second_rows = signatures.lookup(seconds)
    both = first_signed & second_signed
    keep = cosines >= threshold
    close = signature_distance(first_rows[both[first_signed]], second_rows[both[second_signed]])
    keep[both] &= close <= max_distance
    return keep


def _hash_tables(codes: int, max_distance: int) -> tuple[int, int]:
    """How many hash tables (each of an equal share of a code's bits) and bit flips per table to probe, so
    that a range search finds every code within ``max_distance`` bits at the least cost.

    Pigeonhole: codes within ``max_distance`` bits have, in one of ``tables`` disjoint parts, at most
    ``max_distance // tables`` bits apart. A search probes every flip of that many bits in each table and
    checks the codes in the buckets it finds: few tables of many bits need many probes, many tables of few
    bits fill each bucket. Checking a code costs about three probes, as measured on this machine: 100k
    random 7-view signatures within 8 bits took 11 s with 3 tables of 21 bits and 2 flips, 66 s within 6
    bits with the 7 tables of 9 bits and no flips used before."""

    def cost(tables: int) -> float:
        bits, flips = VIEW_BITS // tables, max_distance // tables
        probes = tables * sum(math.comb(bits, k) for k in range(flips + 1))
        return probes * (1 + 3 * codes / 2**bits)

    tables = min(range(1, max_distance + 2), key=cost)
    return tables, max_distance // tables


def signature_pairs(signatures: SignatureTable, max_distance: int) -> tuple[np.ndarray, ...]:
    """``(first ids, second ids, bits)`` of every pair of signed items within ``max_distance`` bits
    (see :func:`signature_distance`; first id < second id), by a FAISS multi-hash range search: every view
    of every item is a code, queried by every item's own view."""
    check_max_distance(max_distance)
    count, views = signatures.rows.shape
    if count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    faiss = faiss_module()
    tables, flips = _hash_tables(count * views, max_distance)
    codes = faiss.IndexBinaryMultiHash(VIEW_BITS, tables, VIEW_BITS // tables)
    codes.nflip = flips
    codes.add(np.ascontiguousarray(signatures.rows).view(np.uint8).reshape(count * views, -1))
    own = np.ascontiguousarray(signatures.rows[:, :1]).view(np.uint8)
    limits, bits, found = codes.range_search(own, max_distance + 1)  # radius is exclusive
    query = np.repeat(np.arange(count), np.diff(limits.astype(np.int64)))
    other = found // views
    first, second = np.minimum(query, other), np.maximum(query, other)
    distinct = first != second
    first, second, bits = first[distinct], second[distinct], bits[distinct]
    # A pair met more than once (both ways, several views): keep its fewest bits.
    order = np.lexsort((bits, second, first))
    first, second, bits = first[order], second[order], bits[order]
    unique = np.ones(len(first), dtype=bool)
    unique[1:] = (first[1:] != first[:-1]) | (second[1:] != second[:-1])
    ids = signatures.ids
    return ids[first[unique]], ids[second[unique]], bits[unique].astype(np.int64)


def pair_cosines(index: GalleryIndex, firsts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """The exact cosine of each pair, from the stored vectors."""
    ids, positions = np.unique(np.concatenate([firsts, seconds]), return_inverse=True)
    vectors = index.vectors(ids.tolist()) if len(ids) else np.zeros((0, index.manifest.dim), np.float32)
    a, b = positions[: len(firsts)], positions[len(firsts) :]
    return np.clip(np.einsum("ij,ij->i", vectors[a], vectors[b]), -1.0, 1.0).astype(np.float32)


def components(count: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The connected component of each of ``count`` nodes in the graph of the edges ``a[i]``-``b[i]``."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(a), dtype=np.int8), (a, b)), shape=(count, count))
    return connected_components(graph, directed=False)[1]


def group_pairs(firsts: np.ndarray, seconds: np.ndarray, scores: np.ndarray) -> list[DuplicateGroup]:
    """Connected components of the pair graph, largest first (then by smallest id)."""
    if len(firsts) == 0:
        return []
    ids, positions = np.unique(np.concatenate([firsts, seconds]), return_inverse=True)
    a, b = positions[: len(firsts)], positions[len(firsts) :]
    component = components(len(ids), a, b)
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
    threshold: float | None = None,
    *,
    max_distance: int = DEFAULT_MAX_DISTANCE,
    neighbours: int = DEFAULT_NEIGHBOURS,
    progress: bool = False,
) -> Duplicates:
    """Groups of near-duplicate items: items joined by chains of verified pairs (see the module's doc).

    ``threshold``: the candidates' cosine cut; default :data:`DEFAULT_THRESHOLD` when every item has a
    signature, else :data:`EMBEDDING_ONLY_THRESHOLD`.
    """
    check_max_distance(max_distance)
    signatures = SignatureTable(index.signatures())
    unsigned = len(index) - len(signatures)
    if threshold is None:
        threshold = DEFAULT_THRESHOLD if unsigned == 0 else EMBEDDING_ONLY_THRESHOLD
    check_threshold(threshold)
    if unsigned == 0:
        firsts, seconds, _ = signature_pairs(signatures, max_distance)
        cosines = pair_cosines(index, firsts, seconds)
        keep = cosines >= threshold
    else:
        firsts, seconds, cosines = candidate_pairs(index, threshold, neighbours=neighbours, progress=progress)
        keep = verify_pairs(
            firsts, seconds, cosines, signatures, threshold=threshold, max_distance=max_distance
        )
    groups = group_pairs(firsts[keep], seconds[keep], cosines[keep])
    return Duplicates(groups, threshold, max_distance, unsigned, len(index))
