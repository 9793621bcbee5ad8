"""Fixtures for the index tests: clustered unit vectors like real embeddings, single-threaded FAISS."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from index.faiss_index import faiss_module


def clustered_vectors(
    count: int, dim: int, *, clusters: int = 30, spread: float = 0.15, seed: int = 0
) -> np.ndarray:
    """Unit vectors in tight clusters around random centres, the way image embeddings of classes sit."""
    centres = np.random.default_rng(1234).standard_normal((clusters, dim))  # the same for every seed
    rng = np.random.default_rng(seed)
    points = centres[rng.integers(clusters, size=count)] + spread * rng.standard_normal((count, dim))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    return points.astype(np.float32)


def entries(count: int, prefix: str = "img") -> list[tuple[str, str | None, str]]:
    """``(path, label, content_hash)`` rows with distinct paths and hashes."""
    return [(f"{prefix}/{i:05d}.png", f"class{i % 7}", f"{prefix}-hash-{i}") for i in range(count)]


@pytest.fixture(autouse=True)
def single_threaded_faiss() -> Iterator[None]:
    """Tiny k-means runs are dominated by OpenMP thread hand-offs on a busy 2-core machine (OPQ training
    measured 20x slower with 2 threads than with 1 there): keep these small tests on one thread."""
    faiss = faiss_module()
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)
