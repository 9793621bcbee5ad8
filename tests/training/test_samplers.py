"""Class-balanced and Magnet neighbourhood batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.losses import LOSSES, MetricLoss
from training.losses.magnet import MagnetLoss
from training.recipes import magnet_clusters, resolve
from training.samplers import ClassBalancedSampler, NeighbourhoodSampler, sampler_for


def _labels(classes: int = 10, per_class: int = 12) -> np.ndarray:
    return np.repeat(np.arange(classes) * 7 + 3, per_class)  # non-contiguous label values


def test_class_balanced_layout() -> None:
    labels = np.concatenate([_labels(), [500, 500]])  # one class with fewer samples than n
    sampler = ClassBalancedSampler(labels, classes=11, samples_per_class=4, seed=1)
    for _ in range(20):
        batch = labels[sampler.next_indices()].reshape(11, 4)
        assert (batch == batch[:, :1]).all(), "consecutive samples_per_class share a label"
        assert len(np.unique(batch[:, 0])) == 11, "distinct classes"
    few = ClassBalancedSampler(_labels(3), classes=8, samples_per_class=2)
    assert len(few.next_indices()) == 6  # all 3 classes when fewer than asked for


def test_class_balanced_draws_without_replacement_when_possible() -> None:
    labels = _labels()
    sampler = ClassBalancedSampler(labels, classes=5, samples_per_class=6, seed=0)
    indices = sampler.next_indices().reshape(5, 6)
    assert all(len(set(row)) == 6 for row in indices)


def test_state_round_trip_continues_the_same_stream() -> None:
    sampler = ClassBalancedSampler(_labels(), classes=4, samples_per_class=3, seed=5)
    sampler.next_indices()
    state = sampler.state_dict()
    expected = [sampler.next_indices() for _ in range(3)]
    restored = ClassBalancedSampler(_labels(), classes=4, samples_per_class=3, seed=99)
    restored.load_state_dict(state)
    assert all(np.array_equal(restored.next_indices(), batch) for batch in expected)


def _magnet(seed: int = 0) -> tuple[NeighbourhoodSampler, np.ndarray, np.ndarray]:
    """Ten classes of 3 well-separated blobs each, in 2-d."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(10), 30)
    blob = np.tile(np.repeat(np.arange(3), 10), 10)
    centres = rng.normal(scale=10.0, size=(10, 3, 2))
    embeddings = centres[labels, blob] + 0.1 * rng.normal(size=(300, 2))
    sampler = NeighbourhoodSampler(labels, clusters=4, samples_per_class=5, clusters_per_class=3, seed=seed)
    sampler.refresh(embeddings)
    return sampler, labels, embeddings


def test_neighbourhood_index_recovers_the_blobs() -> None:
    sampler, labels, _ = _magnet()
    assert len(sampler.centres) == 30
    found_blobs = 0
    for cluster in range(30):
        members = np.flatnonzero(sampler.assignment == cluster)
        assert len(set(labels[members])) == 1, "clusters never mix classes"
        assert sampler.cluster_labels[cluster] == labels[members[0]]
        found_blobs += len(members) == 10 and len(set(members // 10)) == 1
    # k-means (random restarts, no k-means++) can still merge two blobs of a class now and then.
    assert found_blobs >= 24


def test_neighbourhood_batch_is_a_seed_cluster_and_its_nearest_impostors() -> None:
    sampler, _, _ = _magnet()
    indices = sampler.next_indices()
    clusters = sampler.assignment[indices].reshape(4, 5)
    assert (clusters == clusters[:, :1]).all(), "D consecutive examples per cluster"
    seed, impostors = clusters[0, 0], clusters[1:, 0]
    assert all(sampler.cluster_labels[c] != sampler.cluster_labels[seed] for c in impostors)
    others = np.flatnonzero(sampler.cluster_labels != sampler.cluster_labels[seed])
    distance = np.square(sampler.centres[others] - sampler.centres[seed]).sum(1)
    assert set(impostors) == set(others[np.argsort(distance)[:3]])
    info = sampler.batch_info(indices)
    assert torch.equal(info["cluster_ids"], torch.as_tensor(sampler.assignment[indices]))


class _FakeMagnet(MetricLoss):
    def __init__(self, losses: torch.Tensor) -> None:
        super().__init__()
        self.last_sample_losses = losses


def test_seed_clusters_follow_their_loss_and_none_starves() -> None:
    sampler, _, _ = _magnet()
    probabilities = sampler.cluster_probabilities()
    np.testing.assert_allclose(probabilities, 1 / 30)  # nothing known yet: uniform
    # Teach it: cluster 0's examples have loss 9, cluster 1's loss 1, the rest 0.
    for cluster, value in ((0, 9.0), (1, 1.0), *((c, 0.0) for c in range(2, 30))):
        members = np.flatnonzero(sampler.assignment == cluster)
        sampler.after_step(members, _FakeMagnet(torch.full((len(members),), value)))
    probabilities = sampler.cluster_probabilities()
    assert probabilities.sum() == pytest.approx(1.0)
    assert probabilities[0] / probabilities[1] == pytest.approx(
        (0.9 * 0.9 + 0.1 / 30) / (0.9 * 0.1 + 0.1 / 30)
    )
    assert probabilities.min() == pytest.approx(0.1 / 30)  # the floor: zero-loss clusters still drawn
    seeds = [sampler.assignment[sampler.next_indices()[0]] for _ in range(3000)]
    counts = np.bincount(seeds, minlength=30)
    assert counts.min() > 0, "every cluster is drawn as a seed"
    assert counts[0] > counts[1] > counts[2:].max()


def test_unvisited_clusters_count_as_the_largest_known_loss() -> None:
    sampler, _, _ = _magnet()
    members = np.flatnonzero(sampler.assignment == 4)
    sampler.after_step(members, _FakeMagnet(torch.full((len(members),), 2.0)))
    probabilities = sampler.cluster_probabilities()
    np.testing.assert_allclose(probabilities, 1 / 30)  # all others assumed as hard as the known one


def test_sampler_for_follows_the_registry_layout() -> None:
    labels = _labels()
    assert type(sampler_for(LOSSES["magnet"].layout, labels)) is NeighbourhoodSampler
    balanced = sampler_for(LOSSES["angular"].layout, labels, classes=5)
    assert type(balanced) is ClassBalancedSampler
    assert len(balanced.next_indices()) == 5 * LOSSES["angular"].layout.samples_per_class


def test_batch_size_is_what_a_batch_draws() -> None:
    for sampler in (
        ClassBalancedSampler(_labels(), classes=4, samples_per_class=3),
        ClassBalancedSampler(_labels(3), classes=8, samples_per_class=2),  # fewer classes than asked for
        _magnet()[0],
    ):
        assert all(len(sampler.next_indices()) == sampler.batch_size for _ in range(5))
    assert ClassBalancedSampler(_labels(3), classes=8, samples_per_class=2).batch_size == 6


def test_refresh_is_due_at_step_zero_and_every_interval_once() -> None:
    sampler = NeighbourhoodSampler(_labels(), clusters=3, samples_per_class=2, refresh_interval=5)
    embeddings = np.random.default_rng(0).normal(size=(len(_labels()), 4))
    due = []
    for step in range(12):
        if sampler.refresh_due(step):
            sampler.refresh(embeddings)
            due.append(step)
    assert due == [0, 5, 10]
    # A sampler restored from a checkpoint knows how many refreshes happened: no extra one on resume.
    restored = NeighbourhoodSampler(_labels(), clusters=3, samples_per_class=2, refresh_interval=5)
    restored.load_state_dict(sampler.state_dict())
    assert not restored.refresh_due(11) and restored.refresh_due(15)
    assert not ClassBalancedSampler(_labels(), 2, 2).refresh_due(0)


def test_a_class_is_split_into_no_more_clusters_than_it_can_fill() -> None:
    assert magnet_clusters(15, clusters_per_class=4, samples_per_cluster=4) == 1  # 15 < 2 x 4 x 2
    assert magnet_clusters(20, clusters_per_class=4, samples_per_cluster=4) == 2
    assert magnet_clusters(59, clusters_per_class=4, samples_per_cluster=4) == 4  # Cars196's smallest class
    assert magnet_clusters(3, clusters_per_class=4, samples_per_cluster=4) == 1  # never none


def test_magnet_recipe_sees_overlapping_classes_on_a_small_folder() -> None:
    """Issue 44, item 5: 150 photos in 10 folders, each class a few tight groups of near-identical photos
    (a view, a colour) whose spread hides that the classes overlap. Four clusters a class cut out the tight
    groups (1-9 photos each), the batch variance became their small spread, every other class's mean looked
    far in those units and the loss was 0 on every batch; clusters the class can fill keep its spread."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 15)
    groups = np.tile(np.repeat(np.arange(5), 3), 10)  # 5 groups of 3 photos a class
    embeddings = (
        0.5 * rng.normal(size=(10, 32))[labels]  # class centres closer than the groups' spread: overlap
        + rng.normal(size=(10, 5, 32))[labels, groups]
        + 0.05 * rng.normal(size=(150, 32))
    ).astype(np.float32)
    config = resolve("magnet").config("magnet", "folder")
    sampler = sampler_for(LOSSES["magnet"].layout, labels, clusters_per_class=config.clusters_per_class)
    sampler.refresh(embeddings)
    assert np.bincount(sampler.assignment).min() >= sampler.samples_per_class, "D draws need no repeats"
    loss = MagnetLoss(**config.loss_hparams)
    values = []
    for _ in range(20):
        indices = sampler.next_indices()
        batch = torch.from_numpy(embeddings[indices])
        values.append(float(loss(batch, torch.from_numpy(labels[indices]), **sampler.batch_info(indices))))
    assert sum(value > 0 for value in values) >= 15, values
