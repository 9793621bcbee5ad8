"""Predict a query's label from its neighbours: a kNN vote weighted the Magnet-loss way.

Rippel et al., "Metric Learning with Adaptive Density Discrimination" (ICLR 2016), Eq. 6 classifies a point
by a softmax over its nearest cluster centres, each weighted by ``exp(-|r - mu|^2 / (2 sigma^2))``. Here the
neighbours are gallery items rather than cluster centres (a kNN rather than a kNC vote). Vectors are
L2-normalised, so ``|r - x|^2 = 2 - 2 cos(r, x)`` and each neighbour weighs ``exp(-(1 - score) / sigma^2)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Prediction:
    label: str
    confidence: float  # the winning label's share of the total weight, in (0, 1]
    votes: dict[str, float]  # every voting label's share, highest first


def knn_vote(labels: Sequence[str | None], scores: Sequence[float], sigma2: float) -> Prediction | None:
    """Softmax-weighted vote of labelled neighbours; None when no neighbour has a label."""
    if sigma2 <= 0:
        raise ValueError(f"sigma2 must be positive, got {sigma2}")
    labelled = [(label, score) for label, score in zip(labels, scores, strict=True) if label is not None]
    if not labelled:
        return None
    distances = np.array([2.0 - 2.0 * score for _, score in labelled], dtype=np.float64)
    logits = -distances / (2.0 * sigma2)
    weights = np.exp(logits - logits.max())  # shifted for numerical stability; the shares are unchanged
    weights /= weights.sum()
    totals: dict[str, float] = {}
    for (label, _), weight in zip(labelled, weights, strict=True):
        totals[label] = totals.get(label, 0.0) + float(weight)
    votes = dict(sorted(totals.items(), key=lambda pair: pair[1], reverse=True))
    label, confidence = next(iter(votes.items()))
    return Prediction(label, confidence, votes)
