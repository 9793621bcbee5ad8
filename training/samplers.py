"""Mini-batch samplers, chosen from a loss's :class:`~training.losses.registry.BatchLayout`.

* :class:`ClassBalancedSampler` (``classes_x_samples``): m distinct classes with n examples each, laid out
  class by class (ALMN's 26x5, Angular's N/2 x 2, PDDM's >= 4 per class, LoOp's even count per class).
* :class:`NeighbourhoodSampler` (``clusters_x_examples``): Magnet's neighbourhood batches (Rippel et al.
  2016, Section 3.2) over a per-class k-means index of the current embeddings.

A sampler hands out index arrays into the training set; ``batch_info`` gives what the loss needs besides
embeddings and labels. Its state (random generator, cached losses, cluster index) is checkpointed, so a
resumed run continues the same stream.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import torch

from training.losses.base import MetricLoss
from training.losses.registry import BatchLayout
from training.recipes import magnet_clusters


class ClassBalancedSampler:
    """``classes`` distinct classes x ``samples_per_class`` examples, consecutive per class.

    Examples are drawn without replacement within a batch when the class has enough of them, otherwise with
    replacement. With fewer classes than ``classes``, every class is in every batch.
    """

    def __init__(self, labels: np.ndarray, classes: int, samples_per_class: int, seed: int = 0) -> None:
        self.labels = np.asarray(labels)
        self.class_ids, inverse = np.unique(self.labels, return_inverse=True)
        self.members = [np.flatnonzero(inverse == c) for c in range(len(self.class_ids))]
        self.classes = min(classes, len(self.class_ids))
        self.samples_per_class = samples_per_class
        self.rng = np.random.default_rng(seed)

    @property
    def batch_size(self) -> int:
        """The number of examples :meth:`next_indices` draws per batch."""
        return self.classes * self.samples_per_class

    def next_indices(self) -> np.ndarray:
        chosen = self.rng.choice(len(self.members), size=self.classes, replace=False)
        return np.concatenate([self._draw(self.members[c], self.samples_per_class) for c in chosen])

    def _draw(self, members: np.ndarray, count: int) -> np.ndarray:
        return self.rng.choice(members, size=count, replace=len(members) < count)

    def batch_info(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {}

    def after_step(self, indices: np.ndarray, loss: MetricLoss) -> None:
        """Hook for samplers that learn from the loss's ``last_sample_losses`` (no-op here)."""

    def refresh_due(self, step: int) -> bool:
        """Whether :meth:`refresh` must run before the batch of ``step`` (never, here)."""
        return False

    def refresh(self, embeddings: np.ndarray) -> None:
        """Hook for samplers that index the embedding space (no-op here)."""

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


class NeighbourhoodSampler(ClassBalancedSampler):
    """Magnet's neighbourhood sampling over a per-class k-means cluster index.

    * The index: every class's embeddings are clustered by faiss k-means into ``clusters_per_class``
      clusters, fewer for a class too small to fill them with several times D examples each
      (:func:`~training.recipes.magnet_clusters`); :meth:`refresh` rebuilds it from a forward pass over
      the whole training set, every ``refresh_interval`` steps.
    * A batch: a seed cluster I drawn with probability proportional to its mean cached example loss
      (``p_I(I) ∝ L_I``), its ``clusters - 1`` nearest impostor clusters (centres of *other* classes
      nearest to I's centre), and ``samples_per_class`` = D examples from each.
    * Starvation: an example's loss is cached when it is in a batch (:meth:`after_step`, from the loss's
      ``last_sample_losses``, part of every loss's contract); clusters with no cached loss yet count as the
      largest known loss, and every cluster keeps at least ``min_share`` of the uniform probability, so no
      cluster is starved.
    * ``batch_info`` passes the global cluster id of each example as ``cluster_ids``.
    """

    _ARRAYS = ("example_losses", "assignment", "centres", "cluster_labels")

    def __init__(
        self,
        labels: np.ndarray,
        clusters: int,
        samples_per_class: int,
        *,
        clusters_per_class: int = 4,
        refresh_interval: int = 250,
        min_share: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__(labels, clusters, samples_per_class, seed)
        self.clusters = clusters
        self.clusters_per_class = clusters_per_class
        self.refresh_interval = refresh_interval
        self.min_share = min_share
        self.seed = seed
        self.example_losses = np.full(len(self.labels), np.nan)
        self.assignment = np.zeros(len(self.labels), dtype=np.int64)  # global cluster id per example
        self.centres = np.zeros((0, 0), dtype=np.float32)
        self.cluster_labels = np.zeros(0, dtype=self.labels.dtype)
        self.refreshes = 0

    @property
    def batch_size(self) -> int:
        """``clusters`` x D examples (fewer only while the index has fewer than ``clusters`` clusters)."""
        return self.clusters * self.samples_per_class

    def refresh(self, embeddings: np.ndarray) -> None:
        """Re-cluster each class of the training set from its current ``embeddings`` (n, d)."""
        vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
        centres: list[np.ndarray] = []
        cluster_labels = []
        for class_id, members in zip(self.class_ids, self.members, strict=True):
            k = magnet_clusters(len(members), self.clusters_per_class, self.samples_per_class)
            if k == 1:
                local = np.zeros(len(members), dtype=np.int64)
                class_centres = vectors[members].mean(axis=0, keepdims=True)
            else:
                kmeans = faiss.Kmeans(vectors.shape[1], k, niter=20, nredo=5, seed=self.seed + self.refreshes)
                kmeans.cp.min_points_per_centroid = 1  # small classes: no faiss warning, no subsampling
                kmeans.train(vectors[members])
                _, assigned = kmeans.index.search(vectors[members], 1)
                local = assigned[:, 0].astype(np.int64)
                class_centres = kmeans.centroids
            # Renumber to the non-empty clusters only (k-means may leave one empty).
            used, local = np.unique(local, return_inverse=True)
            self.assignment[members] = len(centres) + local
            centres.extend(class_centres[used])
            cluster_labels.extend([class_id] * len(used))
        self.centres = np.asarray(centres, dtype=np.float32)
        self.cluster_labels = np.asarray(cluster_labels)
        self.refreshes += 1

    def refresh_due(self, step: int) -> bool:
        """At step 0 and every ``refresh_interval`` steps; counted, so a resumed run does not re-index."""
        return self.refreshes <= step // self.refresh_interval

    def cluster_probabilities(self) -> np.ndarray:
        """``p_I ∝ L_I`` over clusters, with unknown losses at the largest known and a uniform floor."""
        num = len(self.centres)
        sums = np.bincount(self.assignment, weights=np.nan_to_num(self.example_losses), minlength=num)
        known = np.bincount(self.assignment, weights=~np.isnan(self.example_losses), minlength=num)
        losses = np.divide(sums, known, out=np.full(num, np.nan), where=known > 0)
        fallback = np.nanmax(losses) if np.any(known > 0) else 1.0
        losses = np.where(np.isnan(losses), fallback, losses)
        total = losses.sum()
        proportional = losses / total if total > 0 else np.full(num, 1.0 / num)
        return (1.0 - self.min_share) * proportional + self.min_share / num

    def next_indices(self) -> np.ndarray:
        if len(self.centres) == 0:
            raise RuntimeError(
                "the cluster index is empty: call refresh() with the training embeddings first"
            )
        seed_cluster = self.rng.choice(len(self.centres), p=self.cluster_probabilities())
        impostors = np.flatnonzero(self.cluster_labels != self.cluster_labels[seed_cluster])
        distances = np.square(self.centres[impostors] - self.centres[seed_cluster]).sum(axis=1)
        nearest = impostors[np.argsort(distances, kind="stable")[: self.clusters - 1]]
        chosen = np.concatenate([[seed_cluster], nearest])
        return np.concatenate(
            [self._draw(np.flatnonzero(self.assignment == c), self.samples_per_class) for c in chosen]
        )

    def batch_info(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {"cluster_ids": torch.as_tensor(self.assignment[indices])}

    def after_step(self, indices: np.ndarray, loss: MetricLoss) -> None:
        """Cache the per-example losses the loss kept from this batch (Magnet's; none from most losses)."""
        sample_losses = loss.last_sample_losses
        if sample_losses is not None and len(sample_losses) == len(indices):
            # A repeated example (drawn with replacement) keeps its last value; any is a fine estimate.
            self.example_losses[indices] = sample_losses.detach().float().cpu().numpy()

    def state_dict(self) -> dict[str, Any]:
        # Tensors, so that checkpoints load with torch.load(weights_only=True).
        arrays = {name: torch.from_numpy(getattr(self, name).copy()) for name in self._ARRAYS}
        return {**super().state_dict(), **arrays, "refreshes": self.refreshes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for name in self._ARRAYS:
            setattr(self, name, state[name].numpy())
        self.refreshes = int(state["refreshes"])


def sampler_for(
    layout: BatchLayout,
    labels: np.ndarray,
    *,
    classes: int | None = None,
    samples_per_class: int | None = None,
    clusters_per_class: int = 4,
    refresh_interval: int = 250,
    seed: int = 0,
) -> ClassBalancedSampler:
    """The sampler a loss's batch layout asks for; ``classes``/``samples_per_class`` override the layout."""
    m = classes or layout.classes
    n = samples_per_class or layout.samples_per_class
    if layout.kind == "clusters_x_examples":
        return NeighbourhoodSampler(
            labels,
            m,
            n,
            clusters_per_class=clusters_per_class,
            refresh_interval=refresh_interval,
            seed=seed,
        )
    return ClassBalancedSampler(labels, m, n, seed)
