"""The index bench's data statistics (bench/lib/vector_data.py), on small synthetic inputs."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from bench.lib import vector_data
from bench.lib.vector_data import ArraySource
from index.tuning import exact_neighbours


@pytest.fixture
def data() -> ModuleType:
    return vector_data


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


def test_grown_data_keeps_neighbours_in_one_cell_and_uniform_data_does_not(data: ModuleType) -> None:
    rng = np.random.default_rng(0)
    seeds = data.random_seed_images(200, 20, 32, rng, views=5)
    grown = data.embedding_like(4000, 100, seeds, rng, data.GrowthParams(class_spread=1.0))
    uniform = data.uniform(4000, 100, 32, rng)
    fractions = [
        data.data_statistics(*pair, _truth(*pair))["nearest_cell_fraction"] for pair in (grown, uniform)
    ]
    assert fractions[0] > 0.5 and fractions[0] > 2 * fractions[1]


def test_embedding_like_grows_every_view_of_new_images(data: ModuleType) -> None:
    seeds = data.random_seed_images(50, 5, 16, np.random.default_rng(0), views=4)
    base, queries = data.embedding_like(1001, 30, seeds, np.random.default_rng(1))
    assert base.shape == (1001, 16) and queries.shape == (30, 16)
    np.testing.assert_allclose(np.linalg.norm(base, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(queries, axis=1), 1.0, rtol=1e-5)
    # An image's views (consecutive rows) sit closer to each other than to other images' views.
    images = base[:1000].reshape(250, 4, 16)
    within = np.einsum("id,id->i", images[:, 0], images[:, 1]).mean()
    across = np.einsum("id,id->i", images[:-1, 0], images[1:, 1]).mean()
    assert within > across


def test_spawned_images_depart_from_their_seed_as_far_as_the_spread_says(data: ModuleType) -> None:
    """The growth law: h = 0 copies the seed; as h grows, two images spawned from one seed move apart
    towards the distance of two images of the class (h^2 / (1 + h^2) of its squared distance), so a
    collection grown several times over holds new images, not near-duplicates of one another."""
    rng = np.random.default_rng(0)
    dim, members = 256, 200
    centres = data.unit(1.0 + 0.05 * rng.standard_normal((members, dim), dtype=np.float32))
    seeds = data.SeedImages(centres, np.zeros(members, int), np.zeros((1, members, dim), np.float32))
    pair_distance = np.mean(np.sum((centres[: members // 2] - centres[members // 2 :]) ** 2, axis=1))
    one_seed = np.zeros(400, int)
    for spread in (0.0, 0.5, 1.0, 3.0):
        siblings = data.spawn_images(seeds, one_seed, spread, rng)
        sibling_distance = np.mean(np.sum((siblings[:200] - siblings[200:]) ** 2, axis=1))
        expected = spread**2 / (1 + spread**2)
        assert sibling_distance / pair_distance == pytest.approx(expected, abs=0.1)


def test_spawned_images_keep_their_class_spread(data: ModuleType) -> None:
    rng = np.random.default_rng(0)
    seeds = data.random_seed_images(300, 3, 64, rng, views=2)
    chosen = rng.integers(len(seeds), size=3000)
    spawned = data.spawn_images(seeds, chosen, 1.5, rng)
    for label in range(3):
        real, grown = seeds.centres[seeds.labels == label], spawned[seeds.labels[chosen] == label]
        spread = [np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)) for x in (real, grown)]
        assert spread[1] == pytest.approx(spread[0], rel=0.1)


def test_one_image_a_seed_at_no_spread_gives_back_the_seeds_views(data: ModuleType) -> None:
    seeds = data.random_seed_images(60, 4, 16, np.random.default_rng(0), views=3)
    base, queries = data.embedding_like(50 * 3, 10, seeds, np.random.default_rng(1), data.GrowthParams(0.0))
    real = np.concatenate(
        [seeds.centres[:, None], seeds.centres[:, None] + seeds.view_offsets.swapaxes(0, 1)], 1
    )
    images = {tuple(np.round(image, 4).ravel()) for image in real}
    assert all(tuple(np.round(image, 4).ravel()) in images for image in base.reshape(50, 3, 16))
    assert {tuple(np.round(q, 4)) for q in queries} <= {tuple(np.round(c, 4)) for c in seeds.centres}


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
