"""The small protocol every vector-index backend implements."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np


class VectorIndex(Protocol):
    """Top-k cosine search over L2-normalised float32 vectors with stable int64 ids."""

    dim: int

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None: ...

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids, scores)``, both (n, k); missing neighbours have id -1 and score -inf."""
        ...

    def remove(self, ids: np.ndarray) -> int: ...

    def __len__(self) -> int: ...

    def save(self, directory: Path) -> None: ...


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    """The one place vectors are L2-normalised, so every backend's scores are cosines in [-1, 1]."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"expected a 2-d array of vectors, got shape {vectors.shape}")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)
