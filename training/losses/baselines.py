"""Baseline losses the papers compare against: contrastive, triplet, HPHN triplet, lifted structure, MS.

Every loss is written twice over: a small function on a (B, B) distance or similarity matrix plus the
boolean ``(positive, negative)`` masks of :func:`training.losses.pairs.label_masks` (importable
building blocks, e.g. for the LoOp variants in ``loop.py``), and a thin
:class:`~training.losses.pairs.PairLoss` that turns ``(embeddings, labels)`` into those matrices.

Conventions shared by all five losses:

* Embeddings are L2-normalised inside the loss (``normalize=True``), as pytorch-metric-learning (pml)
  does by default and as every paper compared here does (LoOp, Sec. 3.1 and Alg. 1 line 3). The
  trainer's head already normalises; normalising a unit vector again changes neither the value nor
  the gradient (the Jacobian of the normalisation is a projection, and projecting twice is projecting
  once), so this only costs O(B d) and makes the loss correct for un-normalised callers too.
* Distances are Euclidean, ``D_ij = ||x_i - x_j||``; similarities (MS) are dot products, i.e. cosine
  similarities of the normalised embeddings.
* Pairs are ordered and exclude ``i == j``; a mean over ordered pairs equals the mean over unordered
  pairs because every matrix used is symmetric.
* Degenerate batches (one sample, one class, no positive pair) give a zero whose gradient is
  connected to the input (``dist.sum() * 0``), never NaN: a loss with nothing to average (no
  positive or no negative pair, no valid triplet or anchor) is 0. Contrastive averages its two terms
  separately, so it keeps whichever term still has pairs (e.g. only the pull term in a one-class batch).
  An empty batch (B = 0) raises ValueError.
"""

from __future__ import annotations

import torch
from torch import Tensor

from foundation.errors import InvalidInputError
from training.losses.pairs import PairLoss
from training.losses.registry import BatchLayout, register_loss

# ---------------------------------------------------------------------------------------------------
# Building blocks on (B, B) matrices
# ---------------------------------------------------------------------------------------------------


def zero_loss(reference: Tensor) -> Tensor:
    """A scalar zero whose graph reaches ``reference`` (so ``backward()`` works and gives zero grads)."""
    return reference.sum() * 0


def masked_logsumexp(x: Tensor, mask: Tensor, dim: int = -1, add_one: bool = False) -> Tensor:
    """``log(sum_{mask} exp(x))`` along ``dim``, or ``log(1 + sum_{mask} exp(x))`` with ``add_one``.

    Rows whose mask is empty give 0 (``log 1`` with ``add_one``; by definition without, as pml's
    ``logsumexp`` does). Stable for any magnitude: the row maximum (at least 0 with ``add_one``, the
    implicit ``exp(0)`` term) is factored out, and empty rows never produce ``log 0`` in the graph.
    """
    x = x.masked_fill(~mask, float("-inf"))
    peak = x.amax(dim, keepdim=True).detach()  # the result does not depend on the shift: no grad needed
    peak = peak.clamp_min(0) if add_one else torch.where(torch.isfinite(peak), peak, 0)
    total = (x - peak).exp().sum(dim)
    peak = peak.squeeze(dim)
    if add_one:
        total = total + (-peak).exp()
    # clamp_min keeps log() finite (and its gradient zero) on empty rows, which are replaced below
    out = total.clamp_min(torch.finfo(total.dtype).tiny).log() + peak
    return out if add_one else torch.where(mask.any(dim), out, 0)


def contrastive_loss(
    dist: Tensor,
    pos_mask: Tensor,
    neg_mask: Tensor,
    pos_margin: float,
    neg_margin: float,
    power: float,
) -> Tensor:
    """Contrastive loss (Hadsell, Chopra & LeCun, CVPR 2006, Eq. 4; Chopra et al., CVPR 2005).

    ``L = mean_{(i,j) in P} [D_ij - m_pos]_+^p / p  +  mean_{(i,j) in N} [m_neg - D_ij]_+^p / p``.

    ``p = 2`` with ``m_pos = 0`` is Hadsell's ``1/2 D^2`` / ``1/2 max(0, m - D)^2`` (the ``1/p`` keeps
    Hadsell's 1/2, so the gradient of one term is the hinge itself); ``p = 1`` is pml's
    ``ContrastiveLoss`` per-pair hinge. Positive and negative pairs are averaged separately (pml reduces
    its two sub-losses separately too): a 32 x 4 batch has 384 ordered positive pairs against 15872
    negative ones, and one mean over all pairs would drown the attraction term. Both means run over all
    pairs, including the satisfied (zero) ones; pml's default ``AvgNonZeroReducer`` averages the
    non-zero ones only, which silently re-weights pairs by how many happen to be active.
    """
    # one hinge matrix and one weight matrix (1/|P| on P, 1/|N| on N, 0 on the diagonal): half the
    # (B, B) passes of two separate masked means
    hinge = torch.where(pos_mask, dist - pos_margin, neg_margin - dist).relu()
    pos_w, neg_w = pos_mask.to(dist.dtype), neg_mask.to(dist.dtype)
    weight = pos_w / pos_w.sum().clamp_min(1) + neg_w / neg_w.sum().clamp_min(1)
    return (hinge.pow(power) * weight).sum() / power


def triplet_loss(dist: Tensor, pos_mask: Tensor, neg_mask: Tensor, margin: float) -> Tensor:
    """Triplet loss over all valid triplets (Weinberger & Saul 2009; Schroff et al. 2015; LoOp Eq. 14).

    ``L = mean_{(a,p,n): y_a = y_p, p != a, y_n != y_a} [D_ap - D_an + m]_+``.

    Mean over *all* valid triplets, satisfied ones included: the normaliser is fixed by the batch
    layout, so a triplet's weight does not grow as the others become satisfied (averaging over the
    non-zero triplets, pml's default, is an implicit and batch-dependent hard-mining re-weighting).
    LoOp Eq. 14 divides the same sum by the number of positive pairs instead, which differs from this
    mean by the constant factor ``B - n`` (negatives per anchor) in a class-balanced batch.

    Each anchor's positives are gathered into a padded (B, K) block, K = the most positives any anchor
    has (``n - 1`` for ``m classes x n``), so memory and time are O(B^2 K) rather than O(B^3).
    """
    pos_count = pos_mask.sum(1)
    n_triplets = (pos_count * neg_mask.sum(1)).sum()
    if n_triplets == 0:
        return zero_loss(dist)
    k = int(pos_count.max())
    # stable sort puts each row's positives first, in index order; padded slots are masked out below
    pos_idx = pos_mask.to(torch.uint8).sort(dim=1, descending=True, stable=True).indices[:, :k]
    pos_valid = pos_mask.gather(1, pos_idx)
    d_ap = dist.gather(1, pos_idx)  # (B, K)
    # (B, K, B): anchor, positive, negative
    violation = (d_ap.unsqueeze(2) - dist.unsqueeze(1) + margin).relu()
    valid = pos_valid.unsqueeze(2) & neg_mask.unsqueeze(1)
    return torch.where(valid, violation, 0).sum() / n_triplets


def batch_hard_triplet_loss(dist: Tensor, pos_mask: Tensor, neg_mask: Tensor, margin: float) -> Tensor:
    """Batch-hard triplet loss (Hermans, Beyer & Leibe 2017, "Batch Hard"), LoOp's "HPHN-triplet".

    ``L = mean_a [max_{p: y_p = y_a} D_ap - min_{n: y_n != y_a} D_an + m]_+`` over anchors that have at
    least one positive and one negative. This is exactly pml's ``TripletMarginLoss(margin,
    reducer=MeanReducer())`` fed by ``BatchHardMiner()``. (LoOp Sec. 3.3.2 writes HPHN per positive pair
    (i, j), taking the max/min over both members; its reference code computes the per-anchor hardest
    distances as here. We follow Hermans et al., one term per anchor.) ``max``/``min`` with indices
    send the gradient to one hardest sample, as pml's mined triplet does.
    """
    anchors = pos_mask.any(1) & neg_mask.any(1)
    if not anchors.any():
        return zero_loss(dist)
    hardest_pos = dist.masked_fill(~pos_mask, float("-inf")).max(1).values
    hardest_neg = dist.masked_fill(~neg_mask, float("inf")).min(1).values
    return (hardest_pos[anchors] - hardest_neg[anchors] + margin).relu().mean()


def lifted_structure_loss(
    dist: Tensor,
    pos_mask: Tensor,
    neg_mask: Tensor,
    pos_margin: float,
    neg_margin: float,
) -> Tensor:
    """Lifted structured loss, smooth form (Song et al., CVPR 2016, Eq. 4), as pml's LiftedStructureLoss.

    For each positive pair (i, j):
    ``J_ij = log( sum_{k in N_i} exp(m_neg - D_ik) + sum_{l in N_j} exp(m_neg - D_jl) ) + D_ij - m_pos``
    and ``L = 1 / (2 |P|) sum_{(i,j) in P} [J_ij]_+^2`` (Song's ``alpha`` is ``m_neg``; ``m_pos = 0`` is
    Song's form). pml builds a (|P|, |N|) matrix of which negatives belong to which pair, about
    n B^3 entries for ``m classes x n``; here the two sums are per-row log-sum-exps ``L_i`` and
    ``J_ij = logaddexp(L_i, L_j) + D_ij - m_pos``, evaluated on the positive pairs only: O(B^2) in all.
    """
    has_negative = neg_mask.any(1)
    # a pair counts where one of its members has a negative (every pair of a labelled batch of two classes;
    # a judged batch's masks need not be): an empty row is no term of the sum, not log(1)
    pairs = pos_mask & (has_negative.unsqueeze(0) | has_negative.unsqueeze(1))
    if not pairs.any():
        return zero_loss(dist)
    row_lse = masked_logsumexp(neg_margin - dist, neg_mask, dim=1)
    row_lse = torch.where(has_negative, row_lse, float("-inf"))
    i, j = pairs.nonzero(as_tuple=True)
    j_ij = torch.logaddexp(row_lse[i], row_lse[j]) + dist[i, j] - pos_margin
    return j_ij.relu().pow(2).mean() / 2


def multi_similarity_mining(
    sim: Tensor, pos_mask: Tensor, neg_mask: Tensor, epsilon: float
) -> tuple[Tensor, Tensor]:
    """MS pair mining (Wang et al., CVPR 2019, Sec. 4; LoOp Sec. 3.3.4): keep the informative pairs.

    A negative (i, k) is kept when ``S_ik > min_{y_j = y_i} S_ij - epsilon``, a positive (i, j) when
    ``S_ij < max_{y_k != y_i} S_ik + epsilon``. Anchors with no negative keep no positive and vice
    versa. Mining is selection only: no gradient flows through it (pml mines under ``no_grad`` too).
    """
    with torch.no_grad():
        least_similar_pos = sim.masked_fill(~pos_mask, float("inf")).amin(1, keepdim=True)
        most_similar_neg = sim.masked_fill(~neg_mask, float("-inf")).amax(1, keepdim=True)
        return pos_mask & (sim - epsilon < most_similar_neg), neg_mask & (sim + epsilon > least_similar_pos)


def multi_similarity_loss(
    sim: Tensor,
    pos_mask: Tensor,
    neg_mask: Tensor,
    alpha: float,
    beta: float,
    base: float,
) -> Tensor:
    """Multi-similarity loss (Wang et al., CVPR 2019, Sec. 4; LoOp Sec. 3.3.4) on the given pair masks.

    ``L = 1/m sum_i [ 1/alpha log(1 + sum_{j in P_i} exp(-alpha (S_ij - lambda)))
                    + 1/beta  log(1 + sum_{k in N_i} exp( beta (S_ik - lambda))) ]``, ``lambda = base``.

    The mean runs over all ``m`` anchors (an anchor with no mined pair contributes 0), as in the paper
    and pml's ``MeanReducer``. Pass the masks returned by :func:`multi_similarity_mining`.
    """
    pull = masked_logsumexp(-alpha * (sim - base), pos_mask, dim=1, add_one=True) / alpha
    push = masked_logsumexp(beta * (sim - base), neg_mask, dim=1, add_one=True) / beta
    return (pull + push).mean()


# ---------------------------------------------------------------------------------------------------
# The losses: embeddings + labels -> matrices + masks (PairLoss) -> the equation above
# ---------------------------------------------------------------------------------------------------


class ContrastiveLoss(PairLoss):
    """:func:`contrastive_loss` on the batch (default: Hadsell's squared form, ``power=2``)."""

    def __init__(
        self, pos_margin: float = 0.0, neg_margin: float = 1.0, power: float = 2.0, normalize: bool = True
    ) -> None:
        super().__init__(normalize)
        if power < 1:
            raise InvalidInputError(
                f"power must be >= 1 (the hinge's gradient is unbounded below 1), got {power}"
            )
        self.pos_margin, self.neg_margin, self.power = pos_margin, neg_margin, power

    def pair_loss(self, geometry: Tensor, pos_mask: Tensor, neg_mask: Tensor) -> Tensor:
        return contrastive_loss(geometry, pos_mask, neg_mask, self.pos_margin, self.neg_margin, self.power)


class TripletLoss(PairLoss):
    """:func:`triplet_loss` over all valid triplets of the batch."""

    # margin 0.1: the LoOp reference code's triplet margin (the paper gives no value)
    def __init__(self, margin: float = 0.1, normalize: bool = True) -> None:
        super().__init__(normalize)
        self.margin = margin

    def pair_loss(self, geometry: Tensor, pos_mask: Tensor, neg_mask: Tensor) -> Tensor:
        return triplet_loss(geometry, pos_mask, neg_mask, self.margin)


class BatchHardTripletLoss(PairLoss):
    """:func:`batch_hard_triplet_loss` (HPHN): hardest positive and hardest negative per anchor."""

    # margin 0.2: the LoOp reference code's HPHN margin (the paper gives no value)
    def __init__(self, margin: float = 0.2, normalize: bool = True) -> None:
        super().__init__(normalize)
        self.margin = margin

    def pair_loss(self, geometry: Tensor, pos_mask: Tensor, neg_mask: Tensor) -> Tensor:
        return batch_hard_triplet_loss(geometry, pos_mask, neg_mask, self.margin)


class LiftedStructureLoss(PairLoss):
    """:func:`lifted_structure_loss`, equal to pml's ``LiftedStructureLoss(neg_margin, pos_margin)``."""

    # neg_margin is Song's alpha = 1 (also pml's default)
    def __init__(self, neg_margin: float = 1.0, pos_margin: float = 0.0, normalize: bool = True) -> None:
        super().__init__(normalize)
        self.neg_margin, self.pos_margin = neg_margin, pos_margin

    def pair_loss(self, geometry: Tensor, pos_mask: Tensor, neg_mask: Tensor) -> Tensor:
        return lifted_structure_loss(geometry, pos_mask, neg_mask, self.pos_margin, self.neg_margin)


class MultiSimilarityLoss(PairLoss):
    """:func:`multi_similarity_mining` then :func:`multi_similarity_loss` on the cosine similarities.

    Equal to pml's ``MultiSimilarityLoss(alpha, beta, base)`` fed the pairs of
    ``MultiSimilarityMiner(epsilon)``, except in one corner: when mining keeps at most one positive and
    at most one negative pair in the whole batch, pml returns 0 (its ``GenericPairLoss`` skips
    batches of <= 1 pair per kind) while this returns the equation's value.
    """

    uses_similarity = True

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        epsilon: float = 0.1,
        normalize: bool = True,
    ) -> None:
        super().__init__(normalize)
        self.alpha, self.beta, self.base, self.epsilon = alpha, beta, base, epsilon

    def pair_loss(self, geometry: Tensor, pos_mask: Tensor, neg_mask: Tensor) -> Tensor:
        pos_mask, neg_mask = multi_similarity_mining(geometry, pos_mask, neg_mask, self.epsilon)
        return multi_similarity_loss(geometry, pos_mask, neg_mask, self.alpha, self.beta, self.base)


# ---------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------

_LAYOUT = BatchLayout("classes_x_samples", classes=32, samples_per_class=4, description="32 classes x 4")

register_loss(
    "contrastive",
    ContrastiveLoss,
    layout=_LAYOUT,
    paper="Hadsell, Chopra & LeCun, Dimensionality Reduction by Learning an Invariant Mapping, CVPR 2006",
    summary="Pull positive pairs together, push negative pairs beyond a margin (squared hinges).",
    judged_pairs=True,
)
register_loss(
    "triplet",
    TripletLoss,
    layout=_LAYOUT,
    paper="Weinberger & Saul, JMLR 2009; Schroff et al., FaceNet, CVPR 2015 (LoOp baseline, Eq. 14)",
    summary="Hinge on d(a,p) - d(a,n) + margin, mean over all valid triplets of the batch.",
    judged_pairs=True,
)
register_loss(
    "hphn-triplet",
    BatchHardTripletLoss,
    layout=_LAYOUT,
    paper="Hermans, Beyer & Leibe, In Defense of the Triplet Loss, 2017 (LoOp's HPHN-triplet)",
    summary="Batch-hard triplet: hardest positive and hardest negative per anchor, mean over anchors.",
    judged_pairs=True,
)
register_loss(
    "lifted",
    LiftedStructureLoss,
    layout=_LAYOUT,
    paper="Song et al., Deep Metric Learning via Lifted Structured Feature Embedding, CVPR 2016",
    summary="Smooth lifted structure: each positive pair against all negatives of both members.",
    judged_pairs=True,
)
register_loss(
    "ms",
    MultiSimilarityLoss,
    layout=_LAYOUT,
    paper="Wang et al., Multi-Similarity Loss with General Pair Weighting, CVPR 2019",
    summary="Mine informative pairs (epsilon), then soft-weight them by self and relative similarity.",
    judged_pairs=True,
)
