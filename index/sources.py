"""Where a FAISS build reads stored vectors from: an item store, or a part of one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from index.items import ItemStore


class VectorSource(Protocol):
    def ids(self) -> np.ndarray:
        """Every id, sorted."""
        ...

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """The vectors of ``ids`` (all held by this source), in that order."""
        ...

    def iter_vectors(self, chunk_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(ids, vectors)`` chunks covering the whole source."""
        ...


class StoreSource:
    """The stored vectors of an :class:`ItemStore`, all of them or a subset of ids (one shard's share)."""

    def __init__(self, store: ItemStore, ids: np.ndarray | None = None) -> None:
        self.store = store
        self._ids = np.sort(np.asarray(ids, dtype=np.int64)) if ids is not None else None

    def ids(self) -> np.ndarray:
        return self._ids if self._ids is not None else self.store.ids()

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        return self.store.vectors(ids)

    def iter_vectors(self, chunk_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.store.iter_vectors(chunk_size, self._ids)


class ExcludingSource:
    """A source without some ids (the queries held out while tuning)."""

    def __init__(self, source: VectorSource, excluded: np.ndarray) -> None:
        self.source = source
        self.excluded = np.asarray(excluded, dtype=np.int64)

    def ids(self) -> np.ndarray:
        return np.setdiff1d(self.source.ids(), self.excluded)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        return self.source.vectors(ids)

    def iter_vectors(self, chunk_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for ids, vectors in self.source.iter_vectors(chunk_size):
            keep = ~np.isin(ids, self.excluded)
            if keep.any():
                yield ids[keep], vectors[keep]


def all_ids(sources: Sequence[VectorSource]) -> np.ndarray:
    return np.sort(np.concatenate([source.ids() for source in sources])) if sources else np.zeros(0, np.int64)


def fetch_vectors(sources: Sequence[VectorSource], ids: np.ndarray, dim: int) -> np.ndarray:
    """The vectors of ``ids`` gathered from whichever source holds each one, in ``ids`` order."""
    out = np.zeros((len(ids), dim), dtype=np.float32)
    found = np.zeros(len(ids), dtype=bool)
    for source in sources:
        mask = np.isin(ids, source.ids())
        if mask.any():
            out[mask] = source.vectors(ids[mask])
            found |= mask
    if not found.all():
        raise KeyError(f"no source holds ids {ids[~found][:5].tolist()}")
    return out
