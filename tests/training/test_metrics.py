"""training.metrics against hand-computed cases and pytorch-metric-learning's AccuracyCalculator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.metrics import (
    clustering_metrics,
    evaluate,
    nearest_neighbours,
    neighbourhood_agreement,
    retrieval_metrics,
)


def _clustered(seed: int, classes: int = 12, per_class: int = 9, dim: int = 16, noise: float = 0.9):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim))
    labels = np.repeat(np.arange(classes), per_class)
    embeddings = centres[labels] + noise * rng.normal(size=(len(labels), dim))
    return embeddings.astype(np.float32), labels


def test_hand_computed_recall_and_map_at_r() -> None:
    # Unit vectors at these angles (radians); class 0 at 0, 0.1, 0.3 and class 1 at 0.22, 1.5.
    angles = np.array([0.0, 0.1, 0.3, 0.22, 1.5])
    embeddings = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    labels = np.array([0, 0, 0, 1, 1])
    assert nearest_neighbours(embeddings, 4).tolist() == [
        [1, 3, 2, 4],
        [0, 3, 2, 4],
        [3, 1, 0, 4],
        [2, 1, 0, 4],
        [2, 3, 1, 0],
    ]
    metrics = retrieval_metrics(embeddings, labels, ks=(1, 2))
    assert metrics["recall@1"] == pytest.approx(2 / 5)  # queries 0 and 1
    assert metrics["recall@2"] == pytest.approx(4 / 5)  # all but query 3
    # AP@R per query: R = 2, 2, 2, 1, 1 -> 1/2, 1/2, (1/2)/2, 0, 0.
    assert metrics["map@r"] == pytest.approx((0.5 + 0.5 + 0.25) / 5)


def test_perfect_and_singleton_classes() -> None:
    embeddings, labels = _clustered(0, classes=4, noise=1e-3)
    metrics = evaluate(embeddings, labels)
    assert metrics["recall@1"] == 1.0 and metrics["map@r"] == pytest.approx(1.0)
    assert metrics["nmi"] == pytest.approx(1.0) and metrics["f1"] == pytest.approx(1.0)
    # A class with one item cannot be answered: it is left out, not counted as a miss.
    with_singleton = np.vstack([embeddings, np.ones((1, embeddings.shape[1]))])
    assert retrieval_metrics(with_singleton, np.append(labels, 99))["recall@1"] == 1.0
    with pytest.raises(ValueError, match="no class has two items"):
        retrieval_metrics(embeddings[:3], np.arange(3))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.usefixtures("faiss_with_torch")
def test_recall_at_1_and_map_at_r_match_pytorch_metric_learning(seed: int) -> None:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    embeddings, labels = _clustered(seed, noise=1.2)
    calculator = AccuracyCalculator(
        include=("precision_at_1", "mean_average_precision_at_r"), k="max_bin_count", device=None
    )
    # pml's default k-NN is Euclidean on the raw vectors: give it unit vectors, where it ranks as cosine.
    unit = torch.nn.functional.normalize(torch.from_numpy(embeddings), dim=1)
    theirs = calculator.get_accuracy(unit, torch.from_numpy(labels))
    ours = retrieval_metrics(embeddings, labels)
    assert 0.2 < ours["recall@1"] < 0.95  # a non-trivial case
    assert ours["recall@1"] == pytest.approx(theirs["precision_at_1"], abs=1e-6)
    assert ours["map@r"] == pytest.approx(theirs["mean_average_precision_at_r"], abs=1e-6)


def test_clustering_metrics_track_separation() -> None:
    tight = clustering_metrics(*_clustered(3, noise=0.2))
    loose = clustering_metrics(*_clustered(3, noise=3.0))
    assert tight["nmi"] > 0.9 and tight["f1"] > 0.8
    assert loose["nmi"] < tight["nmi"] and loose["f1"] < tight["f1"]
    # F1 by hand from the pair counts of a fixed assignment is what sklearn's pair confusion gives.
    from sklearn.metrics.cluster import pair_confusion_matrix

    pairs = pair_confusion_matrix([0, 0, 1, 1], [0, 0, 0, 1])
    assert pairs[1, 1] == 2 and pairs[0, 1] == 4  # 1 same-class pair together (ordered: 2), 2 split


def _agreement_by_loops(folder: np.ndarray, held: np.ndarray, views: np.ndarray, k: int) -> np.ndarray:
    """The definition, one photo at a time: its k nearest other photos against its view's k nearest
    photos other than itself (cosine, by sorting)."""
    unit = folder / np.linalg.norm(folder, axis=1, keepdims=True)
    shares = []
    for row, view in zip(held, views, strict=True):
        others = [i for i in range(len(folder)) if i != row]
        by_photo = sorted(others, key=lambda i: -float(unit[row] @ unit[i]))[:k]
        view = view / np.linalg.norm(view)
        by_view = sorted(others, key=lambda i: -float(view @ unit[i]))[:k]
        shares.append(len(set(by_photo) & set(by_view)) / k)
    return np.array(shares)


@pytest.mark.parametrize("seed", [0, 1])
def test_neighbourhood_agreement_matches_its_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder = rng.normal(size=(40, 8)).astype(np.float32)
    held = np.array([3, 17, 25, 39])
    views = folder[held] + rng.normal(scale=0.5, size=(4, 8)).astype(np.float32)
    expected = _agreement_by_loops(folder, held, views, 5)
    np.testing.assert_allclose(neighbourhood_agreement(folder, held, views, 5), expected)
    assert 0 < expected.mean() < 1  # neither trivial case


def test_a_view_that_keeps_the_photo_keeps_its_whole_neighbourhood_and_its_own_photo_never_counts() -> None:
    rng = np.random.default_rng(0)
    folder = rng.normal(size=(30, 6)).astype(np.float32)
    held = np.array([0, 7])
    assert (neighbourhood_agreement(folder, held, 3 * folder[held], 10) == 1).all()  # scale: same direction
    # k above the other photos: every other photo is a neighbour of both, the photo itself of neither
    assert (neighbourhood_agreement(folder[:5], held[:1], -folder[:1], 10) == 1).all()
