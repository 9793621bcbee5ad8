"""The index bench's vectors, and the two statistics that tie its synthetic data to real embeddings.

Data sets (unit vectors):

- ``real``: pretrained embeddings of views of every Cars196 image (see ``real_embeddings``). Queries are
  whole held-out images (view 0, the serving preprocessing); none of their views is in the gallery, as a
  new photo is not in the gallery it is searched against.
- ``embedding``: a synthetic stand-in for ``real`` at any size (dimension ``DIM``): new images grown from
  seed images (the real ones, every view through one random projection), each seed used in turn, so at
  1M each real image seeds about five. A new image is a smoothed bootstrap of its seed's class (``h``,
  ``class_spread``: how far it departs from its seed, keeping the class's spread) and its views its
  seed's real view offsets. Queries are view 0 of held-out new images, the way real
  queries are new photos. ``CALIBRATED`` is fitted on ``real``'s growth by bench/calibrate_synthetic.py.
- ``uniform``: uniform random unit vectors, the worst case for every index (no structure to exploit).

The statistics, measured on held-out queries against the gallery:

- ``tenth_neighbour_cosines``: each query's cosine to its 10th exact neighbour (how close the gallery is);
- ``nearest_cell_fraction``: the fraction of its true top-10 that lie in the query's nearest IVF cell
  (how much of the answer one probe finds; IVF-Flat's recall@10 at nprobe=1).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.faiss_build import TRAIN_SEED, training_size
from index.faiss_index import FaissIndex, faiss_module
from index.protocol import normalize_rows
from index.selection import IndexSpec, ivf_lists
from index.tuning import sample_ids

DIM = 512  # synthetic data; real embeddings keep their own (1280 for EfficientNet-Lite0)
K = 10
VIEWS = 13  # real data: view 0 + 12 augmented: >= 200k vectors from Cars196's 16,185 images
VIEW_SEED = 0
# Real images are extracted in chunks, every view of a chunk before the next chunk, so an unfinished
# extraction already gives complete images (all their views) to measure on.
CHUNK_IMAGES = 1024
GENERATION_CHUNK = 4096  # synthetic images a step: their views' float32 temporaries stay near 100 MB
# Stand-in seed images when no real ones are given (random_seed_images): as many as Cars196 has.
RANDOM_SEED_IMAGES, RANDOM_SEED_CLASSES = 16_384, 196


@dataclass(frozen=True)
class SeedImages:
    """The images synthetic ones are drawn from (real Cars196 images projected to DIM, or random ones)."""

    centres: np.ndarray  # (images, dim) unit: each image's view 0
    labels: np.ndarray  # (images,) its class
    view_offsets: np.ndarray  # (views - 1, images, dim): each other view minus view 0

    def __len__(self) -> int:
        return len(self.centres)


@dataclass(frozen=True)
class GrowthParams:
    """How a synthetic image departs from its seed image (a smoothed bootstrap of the seeds' classes)."""

    # The bootstrap's bandwidth h: 0 copies the seed image, large draws a fresh sample of its class.
    class_spread: float
    view_scale: float = 1.0  # a synthetic image's views: its seed's real view offsets scaled by this


# Fitted by bench/calibrate_synthetic.py (bench/results/synthetic_calibration.md): grown 3.8x from the
# first 4 of Cars196's 16 chunks to the whole real gallery's size, it matches the real statistics (distance
# 0.004; every class_spread 1-5 within 0.015); the 1M rows grow 4.8x from all 16. Grown 5.1x from 3 chunks
# (synthetic_calibration_check3.md) it is a little easier than the real views (nearest-cell fraction 0.40 vs
# 0.36); grown 1x, harder (0.23): each real image's one new image is a fresh draw of its class.
CALIBRATED = GrowthParams(class_spread=3.0, view_scale=1.0)


def unit(vectors: np.ndarray) -> np.ndarray:
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def around(points: np.ndarray, cosine: float, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at about ``cosine`` from each of ``points`` (isotropic noise of matching length)."""
    spread = np.sqrt(1.0 / cosine**2 - 1.0)
    noise = rng.standard_normal(points.shape, dtype=np.float32) / np.sqrt(points.shape[1])
    return unit(points + spread * noise)


def project(vectors: np.ndarray, dim: int, rng: np.random.Generator) -> np.ndarray:
    """``vectors`` through a random orthonormal projection to ``dim`` dimensions, renormalised."""
    projection, _ = np.linalg.qr(rng.standard_normal((vectors.shape[1], dim)))
    return unit(vectors @ projection.astype(np.float32))


def seed_images(views: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> SeedImages:
    """Real images' (views, images, d) embeddings as seeds: every view through one projection to DIM."""
    projected = project(views.reshape(-1, views.shape[2]), DIM, rng).reshape(len(views), -1, DIM)
    return SeedImages(projected[0], labels, projected[1:] - projected[0])


def random_seed_images(
    images: int, classes: int, dim: int, rng: np.random.Generator, views: int = VIEWS
) -> SeedImages:
    """Stand-in seeds without real data: classes of images around random directions, views around those."""
    labels = rng.integers(classes, size=images)
    centres = around(unit(rng.standard_normal((classes, dim), dtype=np.float32))[labels], 0.8, rng)
    offsets = np.stack([around(centres, 0.9, rng) - centres for _ in range(views - 1)])
    return SeedImages(centres, labels, offsets)


def spawn_images(
    seeds: SeedImages, chosen: np.ndarray, class_spread: float, rng: np.random.Generator
) -> np.ndarray:
    """A new image (its view 0) for each seed image ``chosen``: the variance-preserving smoothed bootstrap,
    ``mean + (seed - mean + h * noise) / sqrt(1 + h^2)`` with noise drawn from the class's spread (a random
    combination of its seed images' residuals). Growing the collection adds images as far from their seed as
    the class's real images are from each other, not near-copies of it, whatever ``h``'s fit."""
    spawned = np.empty((len(chosen), seeds.centres.shape[1]), np.float32)
    chosen_labels = seeds.labels[chosen]
    for label in np.unique(chosen_labels):
        members = seeds.centres[seeds.labels == label]
        mean = members.mean(axis=0)
        residuals = members - mean
        rows = np.flatnonzero(chosen_labels == label)
        # sum_i z_i r_i / sqrt(n): the class's covariance (of its seed images), in their span
        noise = rng.standard_normal((len(rows), len(members)), dtype=np.float32) @ residuals
        noise /= np.sqrt(len(members))
        departure = seeds.centres[chosen[rows]] - mean + class_spread * noise
        spawned[rows] = mean + departure / np.sqrt(1.0 + class_spread**2)
    return unit(spawned)


def embedding_like(
    count: int, queries: int, seeds: SeedImages, rng: np.random.Generator, params: GrowthParams = CALIBRATED
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` gallery vectors, the views of new images grown from ``seeds``, and ``queries`` more new
    images' view 0 (held out, as real queries are new photos). A new image's views are its seed's real
    view offsets (scaled by ``view_scale``)."""
    views = len(seeds.view_offsets) + 1
    images = -(-count // views)
    # Seeds dealt out in turn (in random order): every seed grows an image before any grows a second one.
    chosen = rng.permutation(images + queries) % len(seeds)
    centres = spawn_images(seeds, chosen, params.class_spread, rng)
    gallery = np.empty((images, views, centres.shape[1]), np.float32)
    for start in range(0, images, GENERATION_CHUNK):
        step = slice(start, min(start + GENERATION_CHUNK, images))
        gallery[step, 0] = centres[step]
        for view, offsets in enumerate(seeds.view_offsets[:, chosen[step]], start=1):
            gallery[step, view] = unit(centres[step] + params.view_scale * offsets)
    return gallery.reshape(-1, centres.shape[1])[:count], centres[images:]


def uniform(count: int, queries: int, dim: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return unit(rng.standard_normal((count, dim), dtype=np.float32)), unit(
        rng.standard_normal((queries, dim), dtype=np.float32)
    )


def _cars196_rows(data_dir: Path) -> list[dict[str, str]]:
    with (data_dir / "labels.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def cars196_files(data_dir: Path) -> list[Path]:
    """Every Cars196 image, in labels.csv order (the feature cache's key depends on the order)."""
    return [data_dir / row["path"] for row in _cars196_rows(data_dir)]


def cars196_labels(data_dir: Path) -> np.ndarray:
    """Every Cars196 image's class id, in labels.csv order."""
    return np.array([int(row["class_id"]) for row in _cars196_rows(data_dir)])


def real_embeddings(
    data_dir: Path, cache_dir: Path, views: int = VIEWS, *, chunks: int | None = None, progress: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(views, images, 1280) float32 pretrained embeddings of the readable Cars196 images, and their classes.

    They are what a user's index holds before any training: ``dmlsearch export`` without a run writes the
    pretrained EfficientNet-Lite0 with no head (pooled, L2-normalised), which is exactly the ``pooled``
    stage of training/features.py; views 1.. are its seeded random resized crops with flips. ``chunks``
    limits it to the first chunks of CHUNK_IMAGES images (all of them by default).
    """
    from training.features import FeatureExtractor  # torch and onnxruntime: only for real data

    files = cars196_files(data_dir)
    extractor = FeatureExtractor(cache_dir, stage="pooled", progress=progress)
    vectors, ok = [], []
    for number, start in enumerate(range(0, len(files), CHUNK_IMAGES)[:chunks]):
        chunk = files[start : start + CHUNK_IMAGES]
        # Crops are seeded by an image's place in its chunk: a seed per chunk keeps chunks' crops apart.
        sets = [extractor.extract(chunk, view=view, seed=VIEW_SEED + number) for view in range(views)]
        vectors.append(np.stack([feature_set.features for feature_set in sets]))
        ok.append(np.logical_and.reduce([feature_set.ok for feature_set in sets]))
    readable = np.concatenate(ok)
    return np.concatenate(vectors, axis=1)[:, readable], cars196_labels(data_dir)[: len(readable)][readable]


def cars196_seeds(
    data_dir: Path, cache_dir: Path, rng: np.random.Generator, chunks: int | None = None
) -> SeedImages:
    """The readable images of the first ``chunks`` (all by default) as synthetic seeds."""
    return seed_images(*real_embeddings(data_dir, cache_dir, chunks=chunks, progress=False), rng)


def real_split(views: np.ndarray, queries: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The gallery (every view of all but ``queries`` images) and the queries (view 0 of the others)."""
    held_out = np.zeros(views.shape[1], bool)
    held_out[rng.choice(views.shape[1], size=queries, replace=False)] = True
    return views[:, ~held_out].reshape(-1, views.shape[2]), views[0, held_out]


def tenth_neighbour_cosines(base: np.ndarray, queries: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Each query's cosine to its K-th exact neighbour (``truth``: exact top-K ids into ``base``)."""
    return np.einsum("qd,qd->q", queries, base[truth[:, K - 1]])


def nearest_cell_fraction(base_cells: np.ndarray, query_cells: np.ndarray, truth: np.ndarray) -> float:
    """The fraction of the true top-K neighbours that lie in the query's own (nearest) cell."""
    return float(np.mean(base_cells[truth] == query_cells[:, None]))


def ivf_cells(base: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The IVF cell of every gallery vector and query, for the coarse quantizer the product would train
    on ``base`` (index/selection.py's list count, index/faiss_build.py's training sample)."""
    spec = IndexSpec("ivf", f"IVF{ivf_lists(len(base))},Flat", base.shape[1])
    index = FaissIndex.create(spec)
    index.train(base[sample_ids(np.arange(len(base)), training_size(spec, len(base)), TRAIN_SEED)])
    quantizer = faiss_module().extract_index_ivf(index.index).quantizer
    return quantizer.search(base, 1)[1][:, 0], quantizer.search(queries, 1)[1][:, 0]


QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def data_statistics(base: np.ndarray, queries: np.ndarray, truth: np.ndarray) -> dict:
    """Both statistics of one data set: quantiles of the 10th-neighbour cosine, the nearest-cell fraction."""
    cosines = tenth_neighbour_cosines(base, queries, truth)
    return {
        "tenth_cosine": dict(zip(map(str, QUANTILES), np.quantile(cosines, QUANTILES).tolist(), strict=True)),
        "nearest_cell_fraction": nearest_cell_fraction(*ivf_cells(base, queries), truth),
        "nlist": ivf_lists(len(base)),
    }


class ArraySource:
    """Vectors already in memory, as a FAISS build reads them (``index.sources.VectorSource``)."""

    def __init__(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        order = np.argsort(ids)
        self._ids = np.asarray(ids, dtype=np.int64)[order]
        self._vectors = normalize_rows(vectors)[order]

    def ids(self) -> np.ndarray:
        return self._ids

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        positions = np.searchsorted(self._ids, ids)
        if len(ids) and (positions.max() >= len(self._ids) or (self._ids[positions] != ids).any()):
            raise KeyError("ids not held by this source")
        return self._vectors[positions]

    def iter_vectors(self, chunk_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, len(self._ids), chunk_size):
            yield self._ids[start : start + chunk_size], self._vectors[start : start + chunk_size]
