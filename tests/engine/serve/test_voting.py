"""The predict=true vote (Magnet Eq. 6 style)."""

from __future__ import annotations

import math

import pytest

from engine.serve.voting import knn_vote


def test_vote_matches_the_softmax_over_squared_distances() -> None:
    labels = ["car", "car", "bus", None]
    scores = [0.9, 0.6, 0.8, 0.99]
    sigma2 = 0.1
    weights = {i: math.exp(-(2 - 2 * s) / (2 * sigma2)) for i, s in enumerate(scores) if labels[i]}
    total = sum(weights.values())
    prediction = knn_vote(labels, scores, sigma2)
    assert prediction.label == "car"
    assert prediction.confidence == pytest.approx((weights[0] + weights[1]) / total)
    assert prediction.votes["bus"] == pytest.approx(weights[2] / total)
    assert list(prediction.votes) == ["car", "bus"]


def test_a_close_neighbour_outvotes_several_far_ones_at_low_sigma() -> None:
    labels, scores = ["a", "b", "b", "b"], [0.95, 0.5, 0.5, 0.5]
    assert knn_vote(labels, scores, sigma2=0.05).label == "a"
    assert knn_vote(labels, scores, sigma2=100.0).label == "b"  # nearly uniform weights: majority wins


def test_no_labelled_neighbour_means_no_prediction() -> None:
    assert knn_vote([None, None], [0.9, 0.8], 0.1) is None
    assert knn_vote([], [], 0.1) is None
    with pytest.raises(ValueError):
        knn_vote(["a"], [0.9], 0.0)
