"""Batch pair structure shared by the losses: label masks and pairwise geometry."""

from __future__ import annotations

import torch


def label_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(positive, negative)`` boolean (B, B) masks; the diagonal is in neither."""
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


def pairwise_distances(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Euclidean distances between all rows of ``x`` in O(B^2) memory.

    Uses ``|a|^2 + |b|^2 - 2 a.b`` (one matrix product instead of a (B, B, d) difference tensor),
    clamped at ``eps`` so the square root has a finite gradient where two rows coincide.
    """
    squared_norms = x.pow(2).sum(1)
    squared = squared_norms.unsqueeze(0) + squared_norms.unsqueeze(1) - 2.0 * x @ x.T
    return squared.clamp_min(eps).sqrt()
