"""Batch pair structure shared by the losses: label masks and pairwise geometry."""

from __future__ import annotations

from typing import Any

import torch


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
