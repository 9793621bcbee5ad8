"""The index bench's vectors, and the two statistics that tie its synthetic data to real embeddings.

Data sets (unit vectors):

- ``real``: pretrained embeddings of views of every Cars196 image (see ``real_embeddings``). Queries are
  whole held-out images (view 0, the serving preprocessing); none of their views is in the gallery, as a
  new photo is not in the gallery it is searched against.
- ``embedding``: a synthetic stand-in for ``real`` at any size (dimension ``DIM``): clusters of
  ``cluster_size`` vectors at ``member_cosine`` from their centre, centres at ``centre_cosine`` from seed
  vectors (real embeddings, randomly projected). Queries are members of held-out clusters, the way real
  queries are views of held-out images. ``CALIBRATED`` is fitted on ``real`` by bench/calibrate_synthetic.py.
- ``uniform``: uniform random unit vectors, the worst case for every index (no structure to exploit).

The statistics, measured on held-out queries against the gallery:

- ``tenth_neighbour_cosines``: each query's cosine to its 10th exact neighbour (how close the gallery is);
- ``nearest_cell_fraction``: the fraction of its true top-10 that lie in the query's nearest IVF cell
  (how much of the answer one probe finds; IVF-Flat's recall@10 at nprobe=1).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.faiss_build import TRAIN_SEED, training_size
from index.faiss_index import FaissIndex, faiss_module
from index.selection import IndexSpec, ivf_lists
from index.tuning import sample_ids

DIM = 512  # synthetic data; real embeddings keep their own (1280 for EfficientNet-Lite0)
K = 10
VIEWS = 13  # real data: view 0 + 12 augmented: >= 200k vectors from Cars196's 16,185 images
VIEW_SEED = 0
# Real images are extracted in chunks, every view of a chunk before the next chunk, so an unfinished
# extraction already gives complete images (all their views) to measure on.
CHUNK_IMAGES = 1024
GENERATION_CHUNK = 65_536
SEEDS = 1000  # seed vectors of the synthetic clusters (real images of the first chunk)


@dataclass(frozen=True)
class ClusterParams:
    """The synthetic generator's cluster structure."""

    cluster_size: int  # vectors a cluster
    member_cosine: float  # a vector to its cluster centre
    centre_cosine: float  # a cluster centre to its seed
    # Weight of one direction all vectors share (the seeds' mean): pooled ReLU features all point into one
    # cone, so real embeddings are close to each other (high cosines) without being clustered any tighter.
    shared_weight: float = 0.0


# The generator before calibration: tighter and larger clusters than real embeddings form.
OLD = ClusterParams(cluster_size=100, member_cosine=0.9, centre_cosine=0.8)
# Fitted on 10.7k real Cars196 views (bench/results/synthetic_calibration.md). It does not hold at 204k
# (synthetic_calibration_full.md: nearest-cell fraction 0.79 vs 0.36): the SEEDS stay fixed as n grows,
# so clusters pile up around them and IVF finds their neighbours in one cell. Large rows are optimistic.
CALIBRATED = ClusterParams(cluster_size=50, member_cosine=0.94, centre_cosine=0.9, shared_weight=0.3)


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
    return unit(vectors @ projection)


def embedding_like(
    count: int, queries: int, seeds: np.ndarray, rng: np.random.Generator, params: ClusterParams = CALIBRATED
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` gallery vectors in clusters around ``seeds``, and ``queries`` members of other clusters."""
    clusters = max(1, count // params.cluster_size)
    centres = around(seeds[rng.integers(len(seeds), size=clusters + queries)], params.centre_cosine, rng)
    shared = unit(seeds.mean(axis=0, keepdims=True))
    weights = np.sqrt([params.shared_weight, 1.0 - params.shared_weight]).astype(np.float32)

    def members(of_clusters: np.ndarray) -> np.ndarray:
        # In chunks: a million vectors' float32 temporaries at once would take several GB.
        vectors = np.empty((len(of_clusters), seeds.shape[1]), np.float32)
        for start in range(0, len(of_clusters), GENERATION_CHUNK):
            part = around(centres[of_clusters[start : start + GENERATION_CHUNK]], params.member_cosine, rng)
            vectors[start : start + GENERATION_CHUNK] = unit(weights[0] * shared + weights[1] * part)
        return vectors

    # One query per held-out cluster, the way a real query is a new image.
    return members(rng.integers(clusters, size=count)), members(np.arange(clusters, clusters + queries))


def uniform(count: int, queries: int, dim: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return unit(rng.standard_normal((count, dim), dtype=np.float32)), unit(
        rng.standard_normal((queries, dim), dtype=np.float32)
    )


def cars196_files(data_dir: Path) -> list[Path]:
    """Every Cars196 image, in labels.csv order (the feature cache's key depends on the order)."""
    with (data_dir / "labels.csv").open(newline="") as handle:
        return [data_dir / row["path"] for row in csv.DictReader(handle)]


def real_embeddings(
    data_dir: Path, cache_dir: Path, views: int = VIEWS, *, chunks: int | None = None, progress: bool = True
) -> np.ndarray:
    """(views, images, 1280) float32 pretrained embeddings of the readable Cars196 images.

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
    return np.concatenate(vectors, axis=1)[:, np.concatenate(ok)]


def cars196_seeds(data_dir: Path, cache_dir: Path, rng: np.random.Generator) -> np.ndarray:
    """``SEEDS`` synthetic cluster seeds: view-0 embeddings of the first chunk's images, projected to DIM."""
    first = real_embeddings(data_dir, cache_dir, views=1, chunks=1, progress=False)[0]
    return project(first[rng.choice(len(first), size=SEEDS, replace=False)], DIM, rng)


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
