"""Batch pair structure shared by the losses: pair masks, pairwise geometry, and the pair-loss base.

Which pairs of a batch are positive and which negative comes from its labels and, where a person judged a
pair, from ``batch_info[PAIR_SIGNS]`` (:func:`pair_masks`): every pair-based loss reads its pairs there, so
labels, pseudo-labels and judgments (issue 40) reach all of them through one call,
``loss(embeddings, labels, pair_signs=signs)``.

:class:`PairLoss` is the plumbing of every loss written on a (B, B) matrix (the baselines and the LoOp
losses): check the batch, normalise, build the pair masks and the matrix, then call the subclass's
equation, :meth:`PairLoss.pair_loss`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from training.losses.base import MetricLoss

# batch_info key of a batch's judged pairs: (B, B) int8, +1 a certain positive pair (a 👍, or two views of
# one photo), -1 a certain negative (a 👎), 0 where the labels decide.
PAIR_SIGNS = "pair_signs"
UNLABELLED = -1  # the label of a row known only through its judged pairs: the labels pair it with nothing


def label_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(positive, negative)`` boolean (B, B) masks; the diagonal is in neither."""
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


def pair_masks(
    labels: torch.Tensor, batch_info: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's ``(positive, negative)`` (B, B) masks: its labels', overridden by its judged pairs.

    Without ``batch_info[PAIR_SIGNS]`` these are :func:`label_masks`. With it, a pair's nonzero sign wins
    over what the labels say (a 👍 pair is positive even where two pseudo-labels differ, a 👎 pair negative
    even where they agree), and an :data:`UNLABELLED` row pairs only where it is judged. The diagonal is
    in neither mask, whatever its sign.
    """
    positive, negative = label_masks(labels)
    signs = batch_info.get(PAIR_SIGNS)
    if signs is None:
        return positive, negative
    if signs.shape != positive.shape:
        raise ValueError(f"expected {PAIR_SIGNS} of shape {tuple(positive.shape)}, got {tuple(signs.shape)}")
    labelled = labels != UNLABELLED
    both = labelled.unsqueeze(0) & labelled.unsqueeze(1)
    judged = signs != 0
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    positive = torch.where(judged, signs > 0, positive & both) & ~eye
    negative = torch.where(judged, signs < 0, negative & both) & ~eye
    return positive, negative


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
    """Checks the batch, normalises the embeddings, builds the pair masks and the pair geometry, and
    calls :meth:`pair_loss`, the subclass's equation on the (B, B) matrix.

    The geometry is the Euclidean distance matrix, or the dot-product similarity (Gram) matrix with
    ``uses_similarity``; a subclass may refine it (:meth:`geometry`) or restrict the pairs a batch may
    hold (:meth:`check_pairs`). ``normalize`` L2-normalises the embeddings first.
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
        pos_mask, neg_mask = pair_masks(labels, batch_info)
        self.check_pairs(pos_mask)
        x = F.normalize(embeddings, dim=1) if self.normalize else embeddings
        return self.pair_loss(self.geometry(x, neg_mask), pos_mask, neg_mask)

    def check_pairs(self, pos_mask: torch.Tensor) -> None:
        """Raise ValueError for a batch whose pairs the loss is undefined on (any batch is fine here)."""

    def geometry(self, x: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        """The (B, B) matrix :meth:`pair_loss` reads, from the (normalised) embeddings ``x``."""
        return gram_matrix(x) if self.uses_similarity else pairwise_distances(x)

    def pair_loss(
        self, geometry: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError
