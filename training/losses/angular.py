"""Angular loss and its combination with the N-pair loss (NL&AL).

Wang, Zhou, Wen, Liu, Lin, "Deep Metric Learning with Angular Loss", ICCV 2017.

For a triplet (x_a, x_p, x_n) with x_c = (x_a + x_p)/2 the angle at the negative of the re-constructed
triangle is bounded by alpha (Eq. 5), which gives

* the triplet form, Eq. 6:   l_ang(T) = [ ||x_a - x_p||^2 - 4 tan^2(alpha) ||x_n - x_c||^2 ]_+
* the batched N-pair form with the log-sum-exp smooth upper bound, Eq. 8:
      l_ang(B) = 1/N sum_{x_a in B} log[ 1 + sum_{y_n != y_a, y_p} exp(f_{a,p,n}) ],
      f_{a,p,n} = 4 tan^2(alpha) (x_a + x_p)^T x_n - 2 (1 + tan^2(alpha)) x_a^T x_p
* NL&AL, Eq. 9:               l(B) = l_npair(B) + lambda l_ang(B), with l_npair of Eq. 10.

Embeddings are used as given: the paper computes the loss on unnormalised features (Section 4.4), Eq. 8
merely drops the constants that unit length would make exact. Normalise in the model if wanted.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from foundation.errors import InvalidInputError
from training.losses.base import MetricLoss
from training.losses.npair import NPairLoss, log1p_sum_exp, positive_pairs
from training.losses.pairs import gram_matrix, pair_masks
from training.losses.registry import BatchLayout, register_loss

Form = Literal["npair", "triplet"]


class AngularLoss(MetricLoss):
    """Angular loss, Eq. 8 (``form="npair"``, default) or Eq. 6 (``form="triplet"``); alpha in degrees.

    Tuples: every ordered positive pair (x_a, x_p) of the batch, with every sample of another class as a
    negative. With the paper's "N/2 classes x 2" layout these are its N tuplets of N - 2 negatives; for
    larger classes all positive pairs are used, as in pytorch-metric-learning's ``AngularLoss``, which
    this equals (``form="npair"``) on L2-normalised embeddings. pml normalises the anchor and positive
    but not the negatives inside the loss; we normalise nothing (see the module docstring).

    Reduction: Eq. 8 is the mean over the tuples (1/N); Eq. 6 is the mean of the hinge over all
    (anchor, positive, negative) triplets of the batch, each unordered (a, p) counted in both orders
    (the term is symmetric in a and p, so the mean is the same).

    Degenerate batches (no positive pair, a single class, a single sample) give a zero connected to
    the input.
    """

    def __init__(self, alpha: float = 45.0, form: Form = "npair") -> None:
        super().__init__()
        if form not in ("npair", "triplet"):
            raise InvalidInputError(f"form must be 'npair' or 'triplet', got {form!r}")
        if not 0.0 < alpha < 90.0:
            raise InvalidInputError(f"alpha is an angle in degrees in (0, 90), got {alpha}")
        self.alpha = alpha
        self.form = form
        self.sq_tan_alpha = math.tan(math.radians(alpha)) ** 2

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        positive, negative = pair_masks(labels, batch_info)
        anchors, positives = positive_pairs(positive)
        # y_n != y_a, y_p: unlike both members (the labels' negatives, or judged ones)
        negatives = negative.index_select(0, anchors) & negative.index_select(0, positives)  # (pairs, B)
        if not negatives.any():
            return embeddings.sum() * 0.0
        gram = gram_matrix(embeddings)
        # index_select/gather rather than advanced indexing: their backward is a cheap index_add/scatter_add.
        an = gram.index_select(0, anchors)  # x_a^T x_n, for every sample n
        ap = an.gather(1, positives.unsqueeze(1))  # x_a^T x_p
        apn = an + gram.index_select(0, positives)  # (x_a + x_p)^T x_n
        t2 = self.sq_tan_alpha
        if self.form == "npair":
            f = 4.0 * t2 * apn - 2.0 * (1.0 + t2) * ap  # f_{a,p,n}, Eq. 8
            return log1p_sum_exp(f, negatives).mean()
        # Eq. 6 expanded on the Gram matrix: ||x_a - x_p||^2 and ||x_n - x_c||^2 for all (a, p) x n.
        sq = gram.diagonal()
        sq_a, sq_p = sq[anchors].unsqueeze(1), sq[positives].unsqueeze(1)
        ap_sq_dist = sq_a + sq_p - 2.0 * ap
        nc_sq_dist = sq.unsqueeze(0) - apn + 0.25 * (sq_a + sq_p + 2.0 * ap)
        hinge = torch.relu(ap_sq_dist - 4.0 * t2 * nc_sq_dist)
        return torch.where(negatives, hinge, 0.0).sum() / negatives.sum()


class NPairAngularLoss(MetricLoss):
    """NL&AL, Eq. 9: ``l_npair(B) + lambda * l_ang(B)`` with the paper's lambda = 2.

    l_npair is the paper's Eq. 10 (every positive pair is a tuple, every other-class sample a negative,
    no L2 term): :class:`~training.losses.npair.NPairLoss` with ``tuples="all_pairs", l2_reg=0``; l_ang is
    :class:`AngularLoss` in its N-pair form (Eq. 8). Degenerate batches give a connected zero.
    """

    def __init__(self, alpha: float = 45.0, lam: float = 2.0) -> None:
        super().__init__()
        self.npair = NPairLoss(l2_reg=0.0, tuples="all_pairs")
        self.angular = AngularLoss(alpha=alpha, form="npair")
        self.lam = lam

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        return self.npair(embeddings, labels, **batch_info) + self.lam * self.angular(
            embeddings, labels, **batch_info
        )


_PAPER = "Wang, Zhou, Wen, Liu, Lin, Deep Metric Learning with Angular Loss, ICCV 2017"
# Section 3.3 / 4.4: N/2 classes with two images each, mini-batch 128.
_LAYOUT = BatchLayout("classes_x_samples", 64, 2, "N/2 classes x 2")

register_loss(
    "angular",
    AngularLoss,
    layout=_LAYOUT,
    paper=_PAPER,
    summary="Angular loss: bounds the angle at the negative of the triangle (x_c, x_m, x_n); N-pair form "
    "with log-sum-exp (Eq. 8) or triplet hinge form (Eq. 6).",
    judged_pairs=True,
)
register_loss(
    "npair-angular",
    NPairAngularLoss,
    layout=_LAYOUT,
    paper=_PAPER,
    summary="NL&AL (Eq. 9): the paper's N-pair loss (Eq. 10) plus lambda times the angular loss (Eq. 8).",
    judged_pairs=True,
)
