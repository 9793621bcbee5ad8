"""Pseudo-labels for a label-free run: k-means clusters of the current embedding, refreshed as it moves.

:class:`PseudoLabelSampler` wraps the sampler the loss's batch layout asks for (:func:`sampler_for`), so
every registered loss trains on pseudo-labels through the same ``loss(embeddings, labels)`` call:

* Clusters (UDML-SS, Cao et al. 2019): the loose training photos' embeddings are clustered by faiss k-means
  (spherical: the embeddings are compared by cosine) at step 0, from the untrained model's neighbourhoods,
  and every :data:`REFRESH_STEPS` steps; a cluster's id is the pseudo-label, counted from past the real
  classes, so it never collides with one. Photos in class folders keep their real label.
* Copies: a group of byte or edited copies (:mod:`training.copies`) is clustered once (its first photo)
  and all its photos take that cluster, whatever clusters their own embeddings would fall in.
* Instances (ISIF, Ye et al. 2019): every photo drawn is in its batch twice, so the workload gives it two
  different augmented views (cached views or fresh crops): every pair-based loss has certain positives
  besides the cluster's. Samples per class are halved (rounded up) to keep the layout's batch size.
* Losses that cluster themselves (Magnet's neighbourhood sampler) take the pseudo-labels as classes: the
  inner sampler is rebuilt, and its own index refreshed, at every pseudo-label refresh.

Each refresh is recorded (step, clusters, their sizes) for summary.json and the report.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import torch

from training.data import LOOSE
from training.losses.base import MetricLoss
from training.losses.registry import BatchLayout
from training.samplers import ClassBalancedSampler, sampler_for

# Steps between re-clusterings: the head moves slowly at the recipes' lr (frozen Cars196 runs peak after
# about 1,500 steps), so 100 steps re-cluster some 15 times over such a run while costing one forward pass
# of the training photos each time (cheap on cached features). A starting point, not cross-validated yet.
REFRESH_STEPS = 100
# Clusters = loose photos / PHOTOS_PER_CLUSTER: more, smaller clusters than a folder likely has classes
# (over-clustering, as DeepCluster's 10x the classes), so that a cluster's photos are more often of one
# kind; 20 still lets a class-balanced batch draw several photos of each. Not cross-validated yet.
PHOTOS_PER_CLUSTER = 20
# Fine-tuning re-clusters at most once every this many epochs: a refresh then embeds every training photo
# through the whole network at the serving size, about 2/3 of a 160-pixel training step's cost per image
# ((224/160)^2 x a forward's third of a step), so refreshing every epoch would add some 65% to the run and
# every 3 epochs some 22%. 100 steps of Cars196's 8,054 photos are less than an epoch.
FINETUNE_REFRESH_EPOCHS = 3
VIEWS_PER_PHOTO = 2  # each photo drawn is in its batch this many times, as different augmented views


def cluster_count(photos: int) -> int:
    """How many k-means clusters the loose photos are split into (at least 2, at most half the photos)."""
    return int(min(max(2, round(photos / PHOTOS_PER_CLUSTER)), max(2, photos // 2)))


class PseudoLabelSampler(ClassBalancedSampler):
    """The layout's sampler over pseudo-labels that k-means refreshes; see the module's docstring."""

    def __init__(
        self,
        layout: BatchLayout,
        labels: np.ndarray,
        copies: np.ndarray,
        *,
        classes: int | None = None,
        samples_per_class: int | None = None,
        clusters_per_class: int = 4,
        refresh_epochs: float = 0.0,
        seed: int = 0,
    ) -> None:
        """``labels``: real labels, LOOSE for the photos to pseudo-label; ``copies``: per photo, the
        training index of its first byte copy (itself when none); ``refresh_epochs``: re-cluster no more
        often than this many epochs (:data:`FINETUNE_REFRESH_EPOCHS` when fine-tuning)."""
        self.layout = layout
        self.fixed = np.asarray(labels, dtype=np.int64)
        self.copies = np.asarray(copies, dtype=np.int64)
        self.loose = np.flatnonzero(self.fixed == LOOSE)
        self.originals = np.unique(self.copies[self.loose])  # what k-means sees: one row per distinct photo
        self.first_pseudo = int(self.fixed.max(initial=LOOSE)) + 1  # past every real class
        self.batch_classes = classes
        self.samples_per_class = samples_per_class or layout.samples_per_class
        self.clusters_per_class = clusters_per_class
        self.seed = seed
        self.labels = self.fixed.copy()  # what the loss sees: real labels and the current pseudo-labels
        self.refreshes = 0
        self.history: list[dict[str, Any]] = []  # per refresh: step, clusters, sizes (largest first)
        self.inner = self._inner(self.fixed)  # replaced at the first refresh, before any batch
        epoch_steps = len(self.fixed) / self.batch_size
        self.refresh_steps = max(REFRESH_STEPS, int(np.ceil(refresh_epochs * epoch_steps)))

    def _inner(self, labels: np.ndarray) -> ClassBalancedSampler:
        return sampler_for(
            self.layout,
            labels,
            classes=self.batch_classes,
            samples_per_class=-(-self.samples_per_class // VIEWS_PER_PHOTO),
            clusters_per_class=self.clusters_per_class,
            seed=self.seed + self.refreshes,
        )

    @property
    def batch_size(self) -> int:
        return VIEWS_PER_PHOTO * self.inner.batch_size

    def refresh_due(self, step: int) -> bool:
        """At step 0 and every ``refresh_steps`` steps; counted, so a resumed run does not re-cluster."""
        return self.refreshes <= step // self.refresh_steps

    def refresh(self, embeddings: np.ndarray) -> None:
        """Re-cluster the loose photos from the training photos' current ``embeddings`` (n, d)."""
        vectors = np.ascontiguousarray(embeddings[self.originals], dtype=np.float32)
        k = cluster_count(len(self.originals))
        kmeans = faiss.Kmeans(
            vectors.shape[1], k, niter=20, nredo=1, spherical=True, seed=self.seed + self.refreshes
        )
        kmeans.cp.min_points_per_centroid = 1  # small folders: no faiss warning, no subsampling
        kmeans.train(vectors)
        _, assigned = kmeans.index.search(vectors, 1)
        used, clusters = np.unique(assigned[:, 0], return_inverse=True)  # k-means may leave one empty
        cluster_of = dict(zip(self.originals.tolist(), clusters.tolist(), strict=True))
        self.labels = self.fixed.copy()
        self.labels[self.loose] = self.first_pseudo + np.array(
            [cluster_of[int(original)] for original in self.copies[self.loose]], np.int64
        )
        sizes = np.bincount(self.labels[self.loose] - self.first_pseudo)
        step = self.refreshes * self.refresh_steps
        self.history.append(
            {"step": step, "clusters": len(used), "sizes": sorted(sizes.tolist(), reverse=True)}
        )
        self.refreshes += 1
        self.inner = self._inner(self.labels)
        self.inner.refresh(embeddings)  # a sampler that indexes the embedding (Magnet's) indexes it now

    def next_indices(self) -> np.ndarray:
        return np.repeat(self.inner.next_indices(), VIEWS_PER_PHOTO)

    def batch_info(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return self.inner.batch_info(indices)

    def after_step(self, indices: np.ndarray, loss: MetricLoss) -> None:
        self.inner.after_step(indices, loss)

    def state_dict(self) -> dict[str, Any]:
        # Tensors and plain values, so that checkpoints load with torch.load(weights_only=True).
        return {
            "labels": torch.from_numpy(self.labels.copy()),
            "refreshes": self.refreshes,
            "history": self.history,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.labels = state["labels"].numpy()
        self.refreshes = int(state["refreshes"])
        self.history = list(state["history"])
        self.inner = self._inner(self.labels)
        self.inner.load_state_dict(state["inner"])
