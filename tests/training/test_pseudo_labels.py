"""Pseudo-labels of a label-free run: k-means clusters that refresh, two views per photo, copies merged,
real labels kept, and every registered loss training on them through the same call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.train_config import tiny_train_config
from training.data import LOOSE
from training.losses import LOSSES
from training.model import build_objective
from training.pseudo_labels import (
    FINETUNE_REFRESH_EPOCHS,
    REFRESH_STEPS,
    VIEWS_PER_PHOTO,
    PseudoLabelSampler,
    cluster_count,
)
from training.workloads import distinct_views

LAYOUT = LOSSES["contrastive"].layout


def _blobs(assignment: np.ndarray, dim: int = 8) -> np.ndarray:
    """Unit vectors near one of two opposite directions, by ``assignment`` (0 or 1)."""
    rng = np.random.default_rng(0)
    centre = np.eye(dim, dtype=np.float32)[0]
    vectors = np.where(assignment[:, None] == 0, centre, -centre) + 0.05 * rng.normal(
        size=(len(assignment), dim)
    )
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def _same_partition(labels: np.ndarray, groups: np.ndarray) -> bool:
    return all(len(np.unique(labels[groups == g])) == 1 for g in np.unique(groups)) and len(
        np.unique(labels)
    ) == len(np.unique(groups))


def test_pseudo_labels_are_k_means_clusters_of_the_embedding_and_follow_it_at_each_refresh() -> None:
    photos = 40
    assert cluster_count(photos) == 2
    sampler = PseudoLabelSampler(LAYOUT, np.full(photos, LOOSE), np.arange(photos), seed=1)
    assert sampler.refresh_due(0)
    first = np.arange(photos) % 2
    sampler.refresh(_blobs(first))
    assert _same_partition(sampler.labels, first)
    assert not sampler.refresh_due(REFRESH_STEPS - 1) and sampler.refresh_due(REFRESH_STEPS)
    moved = (np.arange(photos) < photos // 2).astype(np.int64)  # the embedding moved: other neighbours
    sampler.refresh(_blobs(moved))
    assert _same_partition(sampler.labels, moved) and not _same_partition(sampler.labels, first)
    assert [entry["step"] for entry in sampler.history] == [0, REFRESH_STEPS]
    assert [entry["clusters"] for entry in sampler.history] == [2, 2]
    assert sampler.history[-1]["sizes"] == [20, 20]


def test_each_photo_drawn_is_in_its_batch_twice_with_one_label() -> None:
    sampler = PseudoLabelSampler(LAYOUT, np.full(40, LOOSE), np.arange(40), seed=0)
    sampler.refresh(_blobs(np.arange(40) % 2))
    for _ in range(5):
        indices = sampler.next_indices()
        pairs = indices.reshape(-1, VIEWS_PER_PHOTO)
        assert (pairs == pairs[:, :1]).all()  # consecutive copies of one photo
        labels = sampler.labels[indices].reshape(-1, VIEWS_PER_PHOTO)
        assert (labels == labels[:, :1]).all()
    assert len(indices) == sampler.batch_size


def test_a_photo_drawn_twice_gets_two_different_cached_views() -> None:
    indices = np.array([7, 7, 3, 3, 9])
    drawn = np.array([2, 2, 4, 1, 0])  # photo 7 drew view 2 twice
    views = distinct_views(indices, drawn, count=5)
    assert views.tolist() == [2, 3, 4, 0, 0]  # its second copy takes the next view; singles keep theirs
    assert distinct_views(np.array([1, 2, 3]), np.array([4, 0, 4]), 5).tolist() == [4, 0, 4]


def test_byte_copies_share_a_pseudo_label_wherever_their_embeddings_lie() -> None:
    photos = 40
    copies = np.arange(photos)
    copies[[1, 3]] = 0  # photos 1 and 3 are byte copies of photo 0
    sampler = PseudoLabelSampler(LAYOUT, np.full(photos, LOOSE), copies, seed=0)
    blobs = np.arange(photos) % 2  # photo 0 in blob 0, its copies 1 and 3 in blob 1
    sampler.refresh(_blobs(blobs))
    assert sampler.labels[1] == sampler.labels[3] == sampler.labels[0]
    assert sampler.labels[5] != sampler.labels[0]  # another photo of blob 1


def test_real_labels_stay_and_pseudo_labels_never_collide_with_them() -> None:
    labels = np.concatenate([np.repeat([0, 1, 2], 4), np.full(40, LOOSE)])
    sampler = PseudoLabelSampler(LAYOUT, labels, np.arange(len(labels)), seed=0)
    sampler.refresh(_blobs(np.arange(len(labels)) % 2))
    assert (sampler.labels[:12] == labels[:12]).all()
    assert sampler.labels[12:].min() >= 3
    assert len(np.unique(sampler.labels)) == 3 + 2


def test_a_resumed_sampler_keeps_its_labels_and_history() -> None:
    sampler = PseudoLabelSampler(LAYOUT, np.full(40, LOOSE), np.arange(40), seed=0)
    sampler.refresh(_blobs(np.arange(40) % 2))
    resumed = PseudoLabelSampler(LAYOUT, np.full(40, LOOSE), np.arange(40), seed=0)
    resumed.load_state_dict(sampler.state_dict())
    assert (resumed.labels == sampler.labels).all() and resumed.history == sampler.history
    assert not resumed.refresh_due(1)
    assert (resumed.next_indices() == sampler.next_indices()).all()


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_trains_on_pseudo_labels_through_the_same_call(loss: str) -> None:
    config = tiny_train_config("unused", "unused", loss=loss)
    objective = build_objective(config, 32)
    labels = np.concatenate([np.repeat([0, 1], 6), np.full(60, LOOSE)])
    sampler = PseudoLabelSampler(LOSSES[loss].layout, labels, np.arange(len(labels)), seed=0)
    rng = np.random.default_rng(0)
    sampler.refresh(_blobs(rng.integers(0, 2, size=len(labels)), dim=16))
    features = torch.from_numpy(np.random.default_rng(1).normal(size=(len(labels), 32)).astype(np.float32))
    indices = sampler.next_indices()
    value = objective(
        features[indices] + 0.01 * torch.randn(len(indices), 32),  # two views of each photo
        torch.as_tensor(sampler.labels[indices]),
        **sampler.batch_info(indices),
    )
    value.backward()
    assert torch.isfinite(value)
    if float(value.detach()) != 0:  # a batch that already meets a margin (LoOp's) has no gradient to give
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in objective.head.parameters())
    sampler.after_step(indices, objective.loss)


def test_fine_tuning_re_clusters_no_more_often_than_every_few_epochs() -> None:
    """A fine-tuning refresh embeds every training photo through the whole network: on a folder whose
    epoch is more than a third of REFRESH_STEPS it waits FINETUNE_REFRESH_EPOCHS epochs instead."""
    photos = 4000  # contrastive's label-free batch: 2 views x 32 = 64 photos, so an epoch is 63 steps
    cached = PseudoLabelSampler(LAYOUT, np.full(photos, LOOSE), np.arange(photos), seed=0)
    tuned = PseudoLabelSampler(
        LAYOUT, np.full(photos, LOOSE), np.arange(photos), refresh_epochs=FINETUNE_REFRESH_EPOCHS, seed=0
    )
    epochs = FINETUNE_REFRESH_EPOCHS * photos / tuned.batch_size
    assert cached.refresh_steps == REFRESH_STEPS and tuned.refresh_steps == int(np.ceil(epochs)) > 100
    tuned.refresh(_blobs(np.arange(photos) % 2))
    assert not tuned.refresh_due(REFRESH_STEPS) and tuned.refresh_due(tuned.refresh_steps)
    small = PseudoLabelSampler(LAYOUT, np.full(40, LOOSE), np.arange(40), refresh_epochs=3, seed=0)
    assert small.refresh_steps == REFRESH_STEPS  # a small folder's 3 epochs are a few steps: at least 100
