"""Magnet loss and its k-nearest-cluster classifier.

Rippel, Paluri, Dollar, Bourdev, "Metric Learning with Adaptive Density Discrimination", ICLR 2016.

* :class:`MagnetLoss` is the stochastic objective of Eq. 5 on a neighbourhood batch of M clusters x D
  examples (Section 3.2, component #1), with the in-batch cluster means and variance.
* :class:`KNCClassifier` is the soft k-nearest-cluster classifier of Eq. 6 (Section 3.3), used for
  evaluation and for label prediction at query time, with the running variance the loss keeps.

The per-class K-means cluster index (Section 3.2, component #2) and the loss-weighted neighbourhood
sampling belong to the trainer; the loss exposes each example's last loss for the latter.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from foundation.errors import InvalidInputError
from training.losses.base import MetricLoss
from training.losses.registry import BatchLayout, register_loss

ArrayLike = np.ndarray | torch.Tensor

# sigma^2 is 0 only when every cluster in the batch is a single example or all points coincide; the floor
# keeps 1 / (2 sigma^2) finite there (the loss is then finite, usually 0 after the hinge).
_VARIANCE_EPS = 1e-12


def cluster_assignments(
    labels: torch.Tensor, cluster_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index the clusters of a batch: ``(assignment, cluster_labels)``.

    A cluster is the set of samples sharing ``(label, cluster_id)``, so cluster ids may be global
    (unique over the whole index) or local to each class. Without ``cluster_ids`` each class is one
    cluster. ``assignment[i]`` is sample i's cluster in ``0..M-1``; ``cluster_labels[m]`` its class.
    """
    ids = labels if cluster_ids is None else cluster_ids
    if ids.shape != labels.shape:
        raise ValueError(f"cluster_ids has shape {tuple(ids.shape)}, labels {tuple(labels.shape)}")
    # One integer key per (label, id) pair, label * span + offset id, because torch.unique over rows is slow.
    labels, ids = labels.long(), ids.long() - ids.min()
    span = ids.max() + 1
    keys, assignment = torch.unique(labels * span + ids, return_inverse=True)
    return assignment, torch.div(keys, span, rounding_mode="floor")


def cluster_means(embeddings: torch.Tensor, assignment: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """Cluster centres ``mu_m = 1/|I_m| sum_{r in I_m} r`` (Eq. 3; Eq. 5's in-batch means), shape (M, d)."""
    sums = embeddings.new_zeros(num_clusters, embeddings.shape[1]).index_add(0, assignment, embeddings)
    counts = torch.bincount(assignment, minlength=num_clusters).to(embeddings.dtype)
    return sums / counts.unsqueeze(1)


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a_i - b_j|^2`` for all rows, (len(a), len(b)), via one matrix product; clamped at 0 against
    cancellation (no square root, so no gradient problem where rows coincide)."""
    squared_norms = a.pow(2).sum(1).unsqueeze(1) + b.pow(2).sum(1).unsqueeze(0)
    return torch.addmm(squared_norms, a, b.T, alpha=-2.0).clamp_min(0.0)


class MagnetLoss(MetricLoss):
    """Magnet loss, Eq. 5 (Rippel et al. 2016)::

        L = 1/(MD) sum_m sum_d { -log [ exp(-|r_d^m - mu_m|^2 / (2 sigma^2) - alpha)
                                        / sum_{mu: C(mu) != C(r_d^m)} exp(-|r_d^m - mu|^2 / (2 sigma^2)) ] }_+

    with the in-batch cluster means ``mu_m`` and the variance of all examples from their own cluster mean
    ``sigma^2 = 1/(MD - 1) sum_m sum_d |r_d^m - mu_m|^2``. This is the variance itself (Eq. 4 writes
    sigma^2; Eq. 5's "sigma-hat" is the same quantity): dividing by its square, as some public
    implementations do, breaks the scale invariance the paper relies on (Section 3.1, "variance
    standardization"). The denominator runs over the in-batch clusters of *other* classes only and is
    evaluated with log-sum-exp, so ``-log(num/den) = |r - mu|^2/(2 sigma^2) + alpha + logsumexp(...)``.

    Choices where the paper is open:

    * sigma^2 carries gradient. The paper backpropagates "through this objective" with sigma-hat defined
      from the batch representations; keeping it in the graph makes the loss exactly invariant to a global
      rescaling of the embeddings (homogeneous of degree 0), so its gradient never simply shrinks or
      inflates the space, which a detached sigma^2 would do.
    * Clusters are given per sample by ``cluster_ids`` (global or per-class ids, see
      :func:`cluster_assignments`); without them each class in the batch is one cluster.
    * The unbiased denominator is N - 1 with N the batch size, as written in the paper, also when the
      clusters are of unequal size; a cluster of one example contributes 0 to the variance sum.
    * ``global_scaling`` s multiplies every exponent, ``exp(-s |r - mu|^2 / (2 sigma^2))``: Gaussians of
      variance sigma^2 / s. Appendix B (Table 1) tunes a "global scaling" per dataset (2.33 to 14.2) that
      the text never defines; we read it as this factor, the only scale the loss is not invariant to.
      sigma^2 sums the spread over all d dimensions, so in a 512-d embedding the exponents of near and far
      clusters differ by a fraction of a unit at s = 1 (Eq. 5 as printed), and the loss mostly shrinks
      clusters. Measured on Cars196 frozen features, validation R@1 fell from 72.0 to 60-66 within 300
      steps at s = 1 and peaked at 76.7 at s = 8 (``bench/train_all.py`` keeps that setting).
    * The running sigma^2 for the kNC classifier (Eq. 6: "a running average of stochastic estimates") is
      an exponential moving average with ``variance_momentum`` (the first batch initialises it), updated
      on every forward in training mode; it is the ``running_variance`` buffer. The classifier's kernel
      variance is :attr:`kernel_variance`, ``running_variance / global_scaling``, the loss's own kernel.

    Degenerate batches: with fewer than two classes no example has an impostor cluster (empty denominator,
    each term is ``{-inf}_+ = 0``), so the loss is a defined zero connected to the input; the running
    variance is then not updated. If sigma^2 is 0 (every cluster a single example) it is floored at
    1e-12: the loss stays finite.

    After each forward, ``last_sample_losses`` (the :class:`~training.losses.base.MetricLoss` contract)
    holds the detached per-example terms (after the hinge), which the neighbourhood sampler averages per
    cluster for ``p_I(I) ∝ L_I`` (Section 3.2).
    """

    running_variance: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(
        self, alpha: float = 1.0, variance_momentum: float = 0.1, global_scaling: float = 1.0
    ) -> None:
        super().__init__()
        if not 0.0 < variance_momentum <= 1.0:
            raise InvalidInputError(f"variance_momentum must be in (0, 1], got {variance_momentum}")
        if not global_scaling > 0.0:
            raise InvalidInputError(f"global_scaling must be positive, got {global_scaling}")
        self.global_scaling = global_scaling
        self.alpha = alpha
        self.variance_momentum = variance_momentum
        self.register_buffer("running_variance", torch.tensor(1.0))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        """``batch_info["cluster_ids"]``: each sample's cluster (absent: one cluster per class)."""
        if embeddings.ndim != 2 or len(embeddings) != len(labels):
            raise ValueError(
                f"expected (B, d) embeddings and B labels, got {tuple(embeddings.shape)}, {len(labels)}"
            )
        assignment, cluster_labels = cluster_assignments(labels, batch_info.get("cluster_ids"))
        if not bool((cluster_labels != cluster_labels[0]).any()):
            self.last_sample_losses = embeddings.new_zeros(len(embeddings))
            return embeddings.sum() * 0.0

        means = cluster_means(embeddings, assignment, len(cluster_labels))
        # Own-cluster distances directly (not by expansion): they are the small ones sigma^2 is made of.
        own = (embeddings - means.index_select(0, assignment)).pow(2).sum(1)  # backward: a cheap index_add
        variance = (own.sum() / (len(embeddings) - 1)).clamp_min(_VARIANCE_EPS)
        if self.training:
            self._track_variance(variance.detach())

        scale = 0.5 * self.global_scaling / variance
        impostor = labels.unsqueeze(1) != cluster_labels.unsqueeze(0)  # C(mu) != C(r), (B, M)
        logits = (-scale * _squared_distances(embeddings, means)).masked_fill(~impostor, float("-inf"))
        terms = F.relu(scale * own + self.alpha + torch.logsumexp(logits, dim=1))
        self.last_sample_losses = terms.detach()
        return terms.mean()

    @property
    def kernel_variance(self) -> float:
        """The Gaussian variance the loss's exponents use, ``sigma^2 / s``: Eq. 6's sigma^2 for kNC."""
        return float(self.running_variance) / self.global_scaling

    @torch.no_grad()
    def _track_variance(self, variance: torch.Tensor) -> None:
        weight = 1.0 if int(self.num_batches_tracked) == 0 else self.variance_momentum
        self.running_variance.lerp_(variance.to(self.running_variance.dtype), weight)
        self.num_batches_tracked += 1


def _as_tensor(x: ArrayLike) -> torch.Tensor:
    return x.detach() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


class KNCClassifier:
    """Soft k-nearest-cluster (kNC) classifier, Eq. 6 (Rippel et al. 2016, Section 3.3)::

        p(c | r) = sum_{l <= L, C(mu_l) = c} exp(-|r - mu_l|^2 / (2 sigma^2))
                   / sum_{l <= L} exp(-|r - mu_l|^2 / (2 sigma^2))

    over the L cluster centres nearest to r; the prediction is the argmax. ``variance`` is sigma^2 (use
    ``MagnetLoss.kernel_variance``), ``num_nearest`` is L (paper: 128; clipped to the number of centres).

    Array in, array out: inputs may be numpy arrays or torch tensors; results come back as the queries'
    type. Exact search with a dense distance matrix and top-k, in chunks of ``chunk_size`` queries to bound
    memory at O(chunk_size x centres); no faiss needed. Columns of :meth:`predict_proba` follow
    ``classes`` (the sorted distinct centre labels); ties in :meth:`predict` go to the smaller label.
    """

    def __init__(
        self,
        centres: ArrayLike,
        centre_labels: ArrayLike,
        variance: float,
        num_nearest: int = 128,
        chunk_size: int = 4096,
    ) -> None:
        self.centres = _as_tensor(centres)
        labels = _as_tensor(centre_labels)
        if self.centres.ndim != 2 or len(self.centres) != len(labels) or len(labels) == 0:
            raise InvalidInputError(
                f"expected (K, d) centres and K labels, got {tuple(self.centres.shape)}, {len(labels)}"
            )
        if not float(variance) > 0.0:
            raise InvalidInputError(f"variance must be positive, got {variance}")
        if num_nearest < 1 or chunk_size < 1:
            raise InvalidInputError("num_nearest and chunk_size must be positive")
        self.classes, self._centre_class = torch.unique(labels, return_inverse=True)
        self.variance = float(variance)
        self.num_nearest = min(num_nearest, len(labels))
        self.chunk_size = chunk_size

    @classmethod
    def from_clusters(
        cls,
        embeddings: ArrayLike,
        labels: ArrayLike,
        cluster_ids: ArrayLike,
        variance: float,
        num_nearest: int = 128,
    ) -> KNCClassifier:
        """Classifier whose centres are the means of the given clusters (e.g. the trainer's K-means index)."""
        embeddings, labels = _as_tensor(embeddings), _as_tensor(labels)
        assignment, cluster_labels = cluster_assignments(labels, _as_tensor(cluster_ids))
        centres = cluster_means(embeddings, assignment, len(cluster_labels))
        return cls(centres, cluster_labels, variance, num_nearest)

    @torch.no_grad()
    def predict_proba(self, queries: ArrayLike) -> ArrayLike:
        """Class probabilities of Eq. 6, shape (Q, len(classes))."""
        q = _as_tensor(queries).to(self.centres)
        probs = torch.cat([self._chunk_proba(chunk) for chunk in q.split(self.chunk_size)])
        return probs.numpy() if isinstance(queries, np.ndarray) else probs

    @torch.no_grad()
    def predict(self, queries: ArrayLike) -> ArrayLike:
        """Eq. 6's ``c_n^* = argmax_c p(c | r_n)``, as labels from ``classes``."""
        probs = _as_tensor(self.predict_proba(queries))
        predicted = self.classes[probs.argmax(dim=1)]
        return predicted.numpy() if isinstance(queries, np.ndarray) else predicted

    def _chunk_proba(self, queries: torch.Tensor) -> torch.Tensor:
        nearest_sq, nearest = torch.topk(
            _squared_distances(queries, self.centres), self.num_nearest, dim=1, largest=False
        )
        weights = torch.softmax(-nearest_sq / (2.0 * self.variance), dim=1)
        probs = queries.new_zeros(len(queries), len(self.classes))
        return probs.scatter_add_(1, self._centre_class[nearest], weights)


register_loss(
    "magnet",
    MagnetLoss,
    layout=BatchLayout(
        "clusters_x_examples", classes=12, samples_per_class=4, description="M clusters x D examples"
    ),
    paper="Rippel et al., Metric Learning with Adaptive Density Discrimination, ICLR 2016 (Eq. 5)",
    summary="Magnet loss: each example vs its own cluster mean and other classes' cluster means, "
    "in units of the batch variance, with gap alpha and a hinge; kNC classifier (Eq. 6) for prediction.",
    when_zero="every example was already nearer its own cluster's mean than any other class's cluster, by "
    "the gap alpha in units of the batch variance: on few training classes there are no close impostor "
    "clusters to learn from (more classes and more images per class give it some)",
)
