"""Synthetic embeddings and index entries."""

from __future__ import annotations

import numpy as np

from index.protocol import Entry


def clustered_vectors(
    count: int, dim: int, *, clusters: int = 30, spread: float = 0.15, seed: int = 0
) -> np.ndarray:
    """Unit vectors in tight clusters around random centres, the way image embeddings of classes sit."""
    centres = np.random.default_rng(1234).standard_normal((clusters, dim))  # the same for every seed
    rng = np.random.default_rng(seed)
    points = centres[rng.integers(clusters, size=count)] + spread * rng.standard_normal((count, dim))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    return points.astype(np.float32)


def entries(count: int, prefix: str = "img", taken: str | None = None) -> list[Entry]:
    """Entries with distinct paths and hashes (seven labels), all taken at ``taken``."""
    return [
        Entry(f"{prefix}/{i:05d}.png", f"class{i % 7}", f"{prefix}-hash-{i}", taken) for i in range(count)
    ]
