"""The predict=true vote (Magnet Eq. 6 style) and the readers-writer lock that guards index writes."""

from __future__ import annotations

import math
import threading
import time

import pytest

from engine.locks import ReadWriteLock
from engine.voting import knn_vote


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


def test_readers_share_the_lock_and_a_writer_excludes_them() -> None:
    lock = ReadWriteLock()
    inside, most_inside, writer_saw = [0], [0], []
    guard = threading.Lock()

    def reader() -> None:
        with lock.read():
            with guard:
                inside[0] += 1
                most_inside[0] = max(most_inside[0], inside[0])
            time.sleep(0.05)
            with guard:
                inside[0] -= 1

    def writer() -> None:
        with lock.write(), guard:
            writer_saw.append(inside[0])

    threads = [threading.Thread(target=reader) for _ in range(4)] + [threading.Thread(target=writer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert most_inside[0] >= 2, "readers were serialised"
    assert writer_saw == [0], "the writer ran while readers were inside"
