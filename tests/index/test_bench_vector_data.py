"""The index bench's data statistics (bench/vector_data.py), on small synthetic inputs."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from index.sources import ArraySource
from index.tuning import exact_neighbours
from tests.helpers import bench_module


@pytest.fixture
def data(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return bench_module("vector_data", monkeypatch)


def _truth(base: np.ndarray, queries: np.ndarray) -> np.ndarray:
    return exact_neighbours(queries, [ArraySource(np.arange(len(base)), base)], 10)


def test_tenth_neighbour_cosine_is_the_tenth_largest_inner_product(data: ModuleType) -> None:
    rng = np.random.default_rng(0)
    base, queries = data.uniform(300, 20, 16, rng)
    cosines = data.tenth_neighbour_cosines(base, queries, _truth(base, queries))
    expected = np.sort(queries @ base.T, axis=1)[:, -10]
    np.testing.assert_allclose(cosines, expected, rtol=1e-5)


def test_nearest_cell_fraction_counts_true_neighbours_in_the_query_cell(data: ModuleType) -> None:
    base_cells = np.array([0, 0, 1, 1, 2])
    truth = np.array([[0, 1, 2], [2, 3, 4]])
    # query 0 lives in cell 0 (2 of its 3 neighbours there), query 1 in cell 2 (1 of 3)
    assert data.nearest_cell_fraction(base_cells, np.array([0, 2]), truth) == pytest.approx(3 / 6)


def test_clustered_data_keeps_neighbours_in_one_cell_and_uniform_data_does_not(data: ModuleType) -> None:
    rng = np.random.default_rng(0)
    seeds = data.unit(rng.standard_normal((20, 32)))
    tight = data.ClusterParams(cluster_size=40, member_cosine=0.97, centre_cosine=0.5)
    clustered = data.embedding_like(4000, 100, seeds, rng, tight)
    uniform = data.uniform(4000, 100, 32, rng)
    fractions = [
        data.data_statistics(*pair, _truth(*pair))["nearest_cell_fraction"] for pair in (clustered, uniform)
    ]
    assert fractions[0] > 0.5 and fractions[0] > 2 * fractions[1]


def test_tighter_clusters_have_closer_tenth_neighbours(data: ModuleType) -> None:
    rng = np.random.default_rng(0)
    seeds = data.unit(rng.standard_normal((20, 64)))
    medians = []
    for member_cosine in (0.7, 0.9):
        params = data.ClusterParams(cluster_size=20, member_cosine=member_cosine, centre_cosine=0.8)
        base, queries = data.embedding_like(3000, 100, seeds, np.random.default_rng(1), params)
        assert base.shape == (3000, 64) and queries.shape == (100, 64)
        np.testing.assert_allclose(np.linalg.norm(base, axis=1), 1.0, rtol=1e-5)
        medians.append(np.median(data.tenth_neighbour_cosines(base, queries, _truth(base, queries))))
    assert medians[0] < medians[1]


def test_real_split_holds_out_every_view_of_the_query_images(data: ModuleType) -> None:
    views, images, dim = 3, 20, 4
    # every vector names its view and image, so the split can be checked value by value
    vectors = np.stack(np.meshgrid(np.arange(views), np.arange(images), indexing="ij"), axis=-1)
    vectors = np.concatenate([vectors, np.zeros((views, images, dim - 2))], axis=-1).astype(np.float32)
    gallery, queries = data.real_split(vectors, 5, np.random.default_rng(0))
    assert gallery.shape == (views * 15, dim) and queries.shape == (5, dim)
    assert set(queries[:, 0]) == {0}  # the serving view
    assert not set(queries[:, 1]) & set(gallery[:, 1])  # no view of a query image is in the gallery
    assert set(queries[:, 1]) | set(gallery[:, 1]) == set(range(images))
