"""Multi-class N-pair loss and the N-pair building blocks shared with the Angular and ALMN losses.

Sohn, "Improved Deep Metric Learning with Multi-class N-pair Loss Objective", NIPS 2016, written as in
Chen & Deng, "ALMN: Deep Embedding Learning with Geometrical Virtual Point Generating", ECCV 2018, Eq. 1:

    L = -1/N sum_i log( e^{x_i^T x_i+} / (e^{x_i^T x_i+} + sum_{y_j != y_i} e^{x_j^T x_i+}) )
        + lambda/(2N) sum_i ||x_i||^2

with x_i+ the anchor, x_i its positive and x_j the positives of the other classes. Every N-pair style
loss in this package reduces to ``log(1 + sum_neg exp(s_neg - s_pos))`` per anchor (the softmax above,
Angular loss Eq. 8 and 10, ALMN Eq. 3 and 8), which :func:`log1p_sum_exp` computes stably.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.nn import functional as F

from foundation.errors import InvalidInputError
from training.losses.base import MetricLoss
from training.losses.pairs import gram_matrix, pair_masks
from training.losses.registry import BatchLayout, register_loss

Tuples = Literal["sohn", "all_pairs"]


def log1p_sum_exp(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Row-wise ``log(1 + sum_{j: mask[:, j]} exp(logits[:, j]))``, shape (rows,).

    The ``1`` is an appended zero logit, so a row without any masked-in entry is exactly ``log 1 = 0``
    with a finite (zero) gradient; masked-out entries are ``-inf`` and get zero gradient.
    """
    masked = logits.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(F.pad(masked, (0, 1), value=0.0), dim=1)


def sohn_tuples(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sohn's (anchor, positive) tuples: per class with >= 2 samples, its first and second sample.

    With the "N/2 classes x 2" layout this is every consecutive pair; further samples of a class are
    unused, exactly as in pytorch-metric-learning's ``NPairsLoss`` (first positive pair per label).
    """
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    rank = torch.tril(same, diagonal=-1).sum(1)  # how many earlier samples share the label
    anchors = torch.nonzero((rank == 0) & (same.sum(1) >= 2)).squeeze(1)
    # Each anchor's row has exactly one sample of rank 1 (its class's second sample), in row order.
    positives = torch.nonzero(same[anchors] & (rank == 1).unsqueeze(0))[:, 1]
    return anchors, positives


def positive_pairs(positive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ordered (anchor, positive) pair of a (B, B) positive mask (:func:`pair_masks`)."""
    anchors, positives = torch.nonzero(positive, as_tuple=True)
    return anchors, positives


def l2_term(embeddings: torch.Tensor, l2_reg: float) -> torch.Tensor:
    """``lambda/(2N) sum_i ||x_i||^2`` over all N embeddings of the batch (ALMN Eq. 1, 3, 8).

    This is also TensorFlow's ``npairs_loss`` regulariser ``lambda/4 (mean|a|^2 + mean|p|^2)`` for the
    "N/2 classes x 2" layout. ``max(N, 1)`` keeps an empty batch at 0.
    """
    return 0.5 * l2_reg * embeddings.pow(2).sum() / max(len(embeddings), 1)


class NPairLoss(MetricLoss):
    """Multi-class N-pair loss with the L2 embedding term (ALMN Eq. 1; Sohn 2016).

    ``tuples="sohn"`` (the registered ``npair``): one (anchor, positive) tuple per class from
    :func:`sohn_tuples`; the negatives of an anchor are the other tuples' positives; the data term is the
    mean over tuples. This equals pytorch-metric-learning's
    ``NPairsLoss(distance=DotProductSimilarity(normalize_embeddings=False))``.

    ``tuples="all_pairs"``: the Angular paper's Eq. 10 (Wang et al. 2017), the N-pair term of NL&AL:
    every ordered positive pair (x_a, x_p) is a tuple and every sample of another class is a negative,
    ``1/N sum_{x_a} log(1 + sum_{y_n != y_a} exp(x_a^T x_n - x_a^T x_p))``.

    The L2 term is ``l2_reg/2 * mean_i ||x_i||^2`` over the whole batch (:func:`l2_term`); the default
    lambda = 0.0005 is ALMN's (Section 5.1), which trains its N-pair baseline with the same settings.
    Degenerate batches (no tuple, or a single class so no negative): the data term is a zero connected
    to the input; the L2 term is unchanged, so the loss is 0 when ``l2_reg == 0``.
    """

    def __init__(self, l2_reg: float = 0.0005, tuples: Tuples = "sohn") -> None:
        super().__init__()
        if tuples not in ("sohn", "all_pairs"):
            raise InvalidInputError(f"tuples must be 'sohn' or 'all_pairs', got {tuples!r}")
        self.l2_reg = l2_reg
        self.tuples = tuples

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        negative = None
        if self.tuples == "sohn":  # Sohn's tuples are one per class: labels only, no judged pairs
            anchors, positives = sohn_tuples(labels)
        else:
            positive, negative = pair_masks(labels, batch_info)
            anchors, positives = positive_pairs(positive)
        if len(anchors) == 0:
            return embeddings.sum() * 0.0 + l2_term(embeddings, self.l2_reg)
        if self.tuples == "sohn":
            # Candidates are the tuples' positives; the tuples have distinct labels, so j != k is negative.
            # index_select, not x[idx]: its backward is an index_add, much cheaper than index_put.
            sims = embeddings.index_select(0, anchors) @ embeddings.index_select(0, positives).T  # x_k+^T x_j
            positive_sims = sims.diagonal().unsqueeze(1)
            negatives = ~torch.eye(len(anchors), dtype=torch.bool, device=embeddings.device)
        else:
            gram = gram_matrix(embeddings)
            sims = gram.index_select(0, anchors)  # x_a^T x_n for every sample n
            positive_sims = sims.gather(1, positives.unsqueeze(1))
            assert negative is not None
            negatives = negative.index_select(0, anchors)  # y_n != y_a, or judged unlike x_a
        return log1p_sum_exp(sims - positive_sims, negatives).mean() + l2_term(embeddings, self.l2_reg)


register_loss(
    "npair",
    NPairLoss,
    layout=BatchLayout("classes_x_samples", 64, 2, "N/2 classes x 2"),
    paper="Sohn, Improved Deep Metric Learning with Multi-class N-pair Loss Objective, NIPS 2016 "
    "(as ALMN Eq. 1, Chen & Deng 2018)",
    summary="Multi-class N-pair loss: per class an anchor and a positive, softmax of the anchor's "
    "similarity to its positive against the other classes' positives, plus lambda/2 mean ||x||^2.",
    fixed={"tuples": "sohn"},
)
