"""Batch pair structure shared by the losses: label masks, pairwise geometry, and the pair-loss base.

:class:`PairLoss` is the plumbing of every loss written on a (B, B) matrix (the baselines and the LoOp
losses): check the batch, normalise, build the label masks and the matrix, then call the subclass's
equation, :meth:`PairLoss.pair_loss`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from training.losses.base import MetricLoss


def label_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(positive, negative)`` boolean (B, B) masks; the diagonal is in neither."""
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


class _SymmetricGram(torch.autograd.Function):
    """``x @ x.T`` whose backward is the single matmul ``(g + g^T) x``; autograd's generic rule for
    ``x @ x.T`` runs one matmul per operand and accumulates the two (B, d) results."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x @ x.T

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return (grad + grad.T) @ x


def gram_matrix(x: torch.Tensor) -> torch.Tensor:
    """All inner products ``x_i^T x_j``, (B, B), with a cheap backward (see :class:`_SymmetricGram`)."""
    return _SymmetricGram.apply(x)


def pairwise_distances(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Euclidean distances between all rows of ``x`` in O(B^2) memory.

    Uses ``|a|^2 + |b|^2 - 2 a.b`` (one matrix product instead of a (B, B, d) difference tensor),
    clamped at ``eps`` so the square root has a finite gradient where two rows coincide.
    """
    squared_norms = x.pow(2).sum(1)
    squared = squared_norms.unsqueeze(0) + squared_norms.unsqueeze(1) - 2.0 * gram_matrix(x)
    return squared.clamp_min(eps).sqrt()


class PairLoss(MetricLoss):
    """Checks the batch, normalises the embeddings, builds the label masks and the pair geometry, and
    calls :meth:`pair_loss`, the subclass's equation on the (B, B) matrix.

    The geometry is the Euclidean distance matrix, or the dot-product similarity (Gram) matrix with
    ``uses_similarity``; a subclass may refine it (:meth:`geometry`) or restrict the labels a batch may
    carry (:meth:`check_labels`). ``normalize`` L2-normalises the embeddings first.
    """

    uses_similarity = False  # True: pass the dot-product similarity matrix instead of distances

    def __init__(self, normalize: bool) -> None:
        super().__init__()
        self.normalize = normalize

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        if embeddings.ndim != 2 or labels.shape != embeddings.shape[:1] or len(labels) == 0:
            raise ValueError(
                f"expected embeddings (B, d) and labels (B,) with B >= 1, got {tuple(embeddings.shape)} "
                f"and {tuple(labels.shape)}"
            )
        self.check_labels(labels)
        x = F.normalize(embeddings, dim=1) if self.normalize else embeddings
        pos_mask, neg_mask = label_masks(labels)
        return self.pair_loss(self.geometry(x, neg_mask), pos_mask, neg_mask)

    def check_labels(self, labels: torch.Tensor) -> None:
        """Raise ValueError for a batch whose labels the loss is undefined on (any batch is fine here)."""

    def geometry(self, x: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        """The (B, B) matrix :meth:`pair_loss` reads, from the (normalised) embeddings ``x``."""
        return gram_matrix(x) if self.uses_similarity else pairwise_distances(x)

    def pair_loss(
        self, geometry: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError
