"""FAISS backend: exact inner-product search over normalised vectors, with stable int64 ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from index.atomic import atomic_path
from index.protocol import normalize_rows


def _faiss():
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "faiss is not installed: pip install 'dmlsearch[cpu]' (or 'dmlsearch[gpu]')"
        ) from err
    return faiss


class FaissIndex:
    FILE_NAME = "vectors.faiss"

    def __init__(self, dim: int, index: object | None = None) -> None:
        faiss = _faiss()
        self.dim = dim
        self.index = index if index is not None else faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        if self.index.d != dim:
            raise ValueError(f"FAISS index has dimension {self.index.d}, expected {dim}")

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        vectors = normalize_rows(vectors)
        if vectors.shape[1] != self.dim:
            raise ValueError(f"vectors have dimension {vectors.shape[1]}, index has {self.dim}")
        self.index.add_with_ids(vectors, np.ascontiguousarray(ids, dtype=np.int64))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = normalize_rows(queries)
        if queries.shape[1] != self.dim:
            raise ValueError(f"queries have dimension {queries.shape[1]}, index has {self.dim}")
        scores, ids = self.index.search(queries, k)
        scores[ids < 0] = -np.inf
        return ids, scores

    def remove(self, ids: np.ndarray) -> int:
        return int(self.index.remove_ids(np.ascontiguousarray(ids, dtype=np.int64)))

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def save(self, directory: Path) -> None:
        faiss = _faiss()
        with atomic_path(directory / self.FILE_NAME) as temporary:
            faiss.write_index(self.index, str(temporary))

    @classmethod
    def load(cls, directory: Path, dim: int) -> FaissIndex:
        return cls(dim, _faiss().read_index(str(directory / cls.FILE_NAME)))
