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
    readers = 4
    # Every reader waits inside the lock for all the others: this only completes if they hold it together.
    all_inside = threading.Barrier(readers, timeout=10)
    readers_in = threading.Event()
    inside, writer_saw, failures = [0], [], []
    guard = threading.Lock()

    def reader() -> None:
        with lock.read():
            with guard:
                inside[0] += 1
            try:
                all_inside.wait()
            except threading.BrokenBarrierError:
                failures.append("readers were serialised")
            readers_in.set()
            time.sleep(0.1)  # stay inside while the writer asks for the lock
            with guard:
                inside[0] -= 1

    def writer() -> None:
        with lock.write(), guard:
            writer_saw.append(inside[0])

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for thread in threads:
        thread.start()
    assert readers_in.wait(timeout=20)
    writing = threading.Thread(target=writer)
    writing.start()
    for thread in [*threads, writing]:
        thread.join(timeout=20)
    assert not failures
    assert writer_saw == [0], "the writer ran while readers were inside"
