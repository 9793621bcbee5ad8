"""LoOp losses: triplet, HPHN-triplet, lifted structure and MS with optimal hard negatives.

Vasudeva, Deora, Bhattacharya, Pal & Chanda, "LoOp: Looking for Optimal Hard Negative Embeddings for
Deep Metric Learning", ICCV 2021, Sec. 3.3 (Eqs. 14-16 and the MS mining rule) and Algorithm 1.

The batch is a sequence of same-class pairs: rows ``(0, 1)``, ``(2, 3)``, ... share a label (Algorithm 1,
line 4; any even number of samples per class). For two pairs of different classes, ``d_{i,j,k,l}`` is
the minimum distance between the curve joining the one pair and the curve joining the other
(:mod:`training.losses.loop_geometry`: geodesic arcs for l2-normalised embeddings, Sec. 3.1-3.2, or
straight segments without normalisation, Sec. 4.2).

One code path serves every loss and both of its forms. All four losses read a (B, B) distance matrix
whose positive entries are the usual ``d_ij`` and whose negative entries are

* ``hard_negatives="endpoints"`` (the base loss, Eqs. 14, 16 and the MS rule as written for samples):
  the usual ``d_ik``;
* ``hard_negatives="loop"`` (the LoOp loss, Eq. 15, the modified HPHN and LS losses, the modified MS
  rule): ``d_{i,i',k,k'}``, the optimum between the curve through ``i`` and its pair partner ``i'`` and
  the curve through ``k`` and its partner ``k'``.

So entry ``(i, k)`` stands for the ordered negative pair ``(k, k')``: both orders of each negative pair
are counted, exactly as the index set ``{(k, l): c[i] != c[k] = c[l]}`` of Eq. 15 restricted to
Algorithm 1's pairs, and a LoOp loss has as many negative terms as its base. Since the arcs contain
their endpoints, ``d_{i,i',k,k'} <= d_ik`` entrywise and every LoOp loss here is >= its base form on
the same batch (a property the tests check).

Conventions and choices (the paper leaves them open):

* ``P`` (Eqs. 14-16) is the set of Algorithm 1's pairs; Eq. 14/15's anchor ``i`` runs over both members
  of a pair (ordered pairs, ``|P| = B``), HPHN/LS terms are symmetric in ``i, j`` (one term per pair,
  ``|P| = B/2``, the same mean). Eq. 14/15 are sums over negatives divided by ``|P|``, as written (the
  ``triplet`` baseline averages over triplets instead: a constant factor ``B - n`` apart).
* HPHN takes the hardest positive over every same-class sample (as written), not only the partner;
  with two samples per class HPHN equals LS (Sec. 3.3.3).
* MS (Wang et al. 2019) uses ``s = 1 - d^2/2`` (Sec. 3.3), the mining of
  :func:`training.losses.baselines.multi_similarity_mining` and the weighting of
  :func:`~training.losses.baselines.multi_similarity_loss` on that matrix, i.e. LoOp replaces the
  negative similarities everywhere: in the negative rule ``s_{i,k,j,l} > min s_ik - eps`` (as written)
  and also in the positive rule's ``max`` over negatives (the paper says the positive rule is
  "unchanged"; the authors' code feeds it the LoOp similarities too). The mean runs over the B anchors.
* Embeddings are l2-normalised inside the loss (Algorithm 1, line 3) unless ``normalize=False``, in
  which case LoOp uses the segment geometry of Sec. 4.2 and the base form raw Euclidean distances.
* Hyperparameters: the paper fixes ``alpha_m = 2``, ``beta_m = 50`` (Sec. 4) and ``lambda = 0.5`` in its
  MS ablation (Fig. 3c); it gives no margin or ``epsilon`` default, so these are the authors' released
  code's: triplet 0.1, HPHN 0.2, LS 0.2, ``epsilon = 0.1`` (also MS's own). Batches: 32 samples (Sec. 4,
  CUB/Cars), 2 per class for triplet/LS (HPHN = LS at 2, Sec. 3.3.3), 4 classes for HPHN (Fig. 3a),
  4 per class for MS (Fig. 3c-d).

Degenerate batches: a batch of one class has no negative and gives a zero connected to the graph. A
batch that is not made of consecutive same-class pairs (odd size, a single sample, a pair with two
labels) raises ValueError: LoOp's curves are undefined there.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.autograd.function import once_differentiable

from foundation.errors import InvalidInputError
from training.losses.baselines import multi_similarity_loss, multi_similarity_mining
from training.losses.loop_geometry import Geometry, pair_of_pair_distances
from training.losses.pairs import PairLoss, pairwise_distances
from training.losses.registry import BatchLayout, register_loss

HardNegatives = Literal["loop", "endpoints"]


def check_pair_layout(pos_mask: torch.Tensor) -> None:
    """Raise ValueError unless rows ``(0, 1)``, ``(2, 3)``, ... are positive pairs (Algorithm 1, line 4):
    same-class pairs, or pairs a person judged alike (:func:`~training.losses.pairs.pair_masks`)."""
    size = len(pos_mask)
    if size < 2 or size % 2:
        raise ValueError(f"LoOp needs an even batch of consecutive same-class pairs, got {size} labels")
    if not bool(pos_mask[0::2, 1::2].diagonal().all()):
        raise ValueError("LoOp needs consecutive same-class pairs: labels[0::2] must equal labels[1::2]")


def loop_distance_matrix(
    dist: torch.Tensor, neg_mask: torch.Tensor, hard_negatives: HardNegatives, geometry: Geometry
) -> torch.Tensor:
    """``dist`` with each negative entry ``(i, k)`` replaced as ``hard_negatives`` says (module doc).

    ``"loop"``: ``d_{i,i',k,k'}`` between the curves of the pairs of ``i`` and ``k`` (``i'``, ``k'`` the
    partners), computed once per pair of pairs (Algorithm 1, lines 5-6) and spread to the 2 x 2 block.
    """
    if hard_negatives == "endpoints":
        return dist
    if hard_negatives != "loop":
        raise ValueError(f"unknown hard_negatives {hard_negatives!r}; choose 'loop' or 'endpoints'")
    optimum = pair_of_pair_distances(dist.square(), geometry).distance
    return torch.where(neg_mask, _SpreadToSamples.apply(optimum), dist)


class _SpreadToSamples(torch.autograd.Function):
    """(B/2, B/2) values of pairs of pairs -> (B, B), each value on its pairs' 2 x 2 block of samples.

    The backward is the sum of the four strided blocks: autograd's backward of ``expand`` is a strided
    reduction several times slower at these sizes.
    """

    @staticmethod
    def forward(ctx: Any, pairwise: torch.Tensor) -> torch.Tensor:
        pairs = len(pairwise)
        return pairwise[:, None, :, None].expand(pairs, 2, pairs, 2).reshape(2 * pairs, 2 * pairs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad[0::2, 0::2] + grad[0::2, 1::2] + grad[1::2, 0::2] + grad[1::2, 1::2]


def pair_triplet_loss(dist: torch.Tensor, neg_mask: torch.Tensor, margin: float) -> torch.Tensor:
    """Triplet loss over the batch's pairs, Eq. 14 (``endpoints``) / Eq. 15 (``loop``).

    ``L = 1/|P| sum_{(i,j) in P} sum_{k: c[k] != c[i]} [d_ij - d_ik + m]_+`` with ``P`` the ordered pairs
    of Algorithm 1 (``j`` = the partner of ``i``, ``|P| = B``) and ``d_ik`` the matrix's negative entry.
    """
    partner = torch.arange(len(dist), device=dist.device) ^ 1
    positive = dist.gather(1, partner.unsqueeze(1))  # (B, 1): d_ij
    return torch.where(neg_mask, (positive - dist + margin).relu(), 0).sum() / len(dist)


def pair_hardest_negative_loss(
    dist: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor, margin: float, hardest_positive: bool
) -> torch.Tensor:
    """HPHN-triplet (Sec. 3.3.2, ``hardest_positive=True``) or lifted structure (Eq. 16) per pair.

    ``L = 1/|P| sum_{(i,j) in P} [D+_ij + m - min(min_{c[k] != c[i]} d_ik, min_{c[l] != c[j]} d_jl)]_+``
    with ``D+_ij = max(max_{c[k] = c[i]} d_ik, max_{c[l] = c[j]} d_jl)`` (HPHN) or ``d_ij`` (LS). With
    the ``loop`` matrix the inner min is ``min_{c[i] != c[k] = c[l]} d_{i,j,k,l}`` as in the modified
    losses. A pair with no negative (one-class batch) contributes 0.
    """
    pairs = len(dist) // 2
    if hardest_positive:
        rows = dist.masked_fill(~pos_mask, float("-inf"))
        positive = rows.view(pairs, -1).amax(1)  # both members' rows at once
    else:
        positive = dist[0::2, 1::2].diagonal()
    negative = dist.masked_fill(~neg_mask, float("inf")).view(pairs, -1).amin(1)
    has_negative = neg_mask.view(pairs, -1).any(1)  # either member's row
    return torch.where(has_negative, (positive + margin - negative).relu(), 0).mean()


class _LoOpLoss(PairLoss):
    """The pair losses on LoOp's batches: consecutive same-class pairs, negatives from ``hard_negatives``.

    Only the equation (:meth:`~training.losses.pairs.PairLoss.pair_loss`) differs between the four.
    """

    def __init__(self, hard_negatives: HardNegatives, normalize: bool) -> None:
        super().__init__(normalize)
        if hard_negatives not in ("loop", "endpoints"):
            raise InvalidInputError(
                f"unknown hard_negatives {hard_negatives!r}; choose 'loop' or 'endpoints'"
            )
        self.hard_negatives = hard_negatives

    def check_pairs(self, pos_mask: torch.Tensor) -> None:
        check_pair_layout(pos_mask)

    def geometry(self, x: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        curves: Geometry = "arc" if self.normalize else "segment"  # Sec. 3.1-3.2 / Sec. 4.2
        return loop_distance_matrix(pairwise_distances(x), neg_mask, self.hard_negatives, curves)


class LoOpTripletLoss(_LoOpLoss):
    """Triplet loss with optimal hard negatives, Eq. 15 (``hard_negatives="endpoints"``: Eq. 14)."""

    def __init__(
        self, margin: float = 0.1, hard_negatives: HardNegatives = "loop", normalize: bool = True
    ) -> None:
        super().__init__(hard_negatives, normalize)
        self.margin = margin

    def pair_loss(self, dist: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        return pair_triplet_loss(dist, neg_mask, self.margin)


class LoOpHPHNTripletLoss(_LoOpLoss):
    """HPHN-triplet loss with optimal hard negatives (Sec. 3.3.2, modified form; base: HPHN per pair)."""

    def __init__(
        self, margin: float = 0.2, hard_negatives: HardNegatives = "loop", normalize: bool = True
    ) -> None:
        super().__init__(hard_negatives, normalize)
        self.margin = margin

    def pair_loss(self, dist: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        return pair_hardest_negative_loss(dist, pos_mask, neg_mask, self.margin, hardest_positive=True)


class LoOpLiftedStructureLoss(_LoOpLoss):
    """Lifted structure loss with optimal hard negatives (Sec. 3.3.3, modified Eq. 16; base: Eq. 16).

    This is the hard (min) form the LoOp paper writes, not Song et al.'s smooth log-sum-exp form of
    the ``lifted`` baseline.
    """

    def __init__(
        self, margin: float = 0.2, hard_negatives: HardNegatives = "loop", normalize: bool = True
    ) -> None:
        super().__init__(hard_negatives, normalize)
        self.margin = margin

    def pair_loss(self, dist: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        return pair_hardest_negative_loss(dist, pos_mask, neg_mask, self.margin, hardest_positive=False)


class LoOpMultiSimilarityLoss(_LoOpLoss):
    """MS loss with optimal hard negatives (Sec. 3.3.4): MS mining and weighting on ``s = 1 - d^2/2``.

    ``alpha``, ``beta``, ``base`` are the paper's ``alpha_m``, ``beta_m``, ``lambda``; ``epsilon`` is the
    mining margin. With ``hard_negatives="endpoints"`` this is the MS loss with MS mining.
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        epsilon: float = 0.1,
        hard_negatives: HardNegatives = "loop",
        normalize: bool = True,
    ) -> None:
        super().__init__(hard_negatives, normalize)
        self.alpha, self.beta, self.base, self.epsilon = alpha, beta, base, epsilon

    def pair_loss(self, dist: torch.Tensor, pos_mask: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        sim = 1 - dist.square() / 2  # Sec. 3.3: s_ij = 1 - d_ij^2 / 2 (for LoOp: s_{i,k,j,l})
        pos_mask, neg_mask = multi_similarity_mining(sim, pos_mask, neg_mask, self.epsilon)
        return multi_similarity_loss(sim, pos_mask, neg_mask, self.alpha, self.beta, self.base)


# ---------------------------------------------------------------------------------------------------
# Registration: the LoOp forms. The base forms are the same classes with hard_negatives="endpoints".
# ---------------------------------------------------------------------------------------------------

_PAPER = (
    "Vasudeva et al., LoOp: Looking for Optimal Hard Negative Embeddings for Deep Metric Learning, ICCV 2021"
)
_PAIRS = "even number per class"

register_loss(
    "loop-triplet",
    LoOpTripletLoss,
    layout=BatchLayout("classes_x_samples", classes=16, samples_per_class=2, description=_PAIRS),
    paper=f"{_PAPER} (Eq. 15)",
    summary="Triplet hinge whose negative distance is the closest approach of the two pairs' arcs.",
    fixed={"hard_negatives": "loop"},
    judged_pairs=True,
)
register_loss(
    "loop-hphn-triplet",
    LoOpHPHNTripletLoss,
    layout=BatchLayout("classes_x_samples", classes=4, samples_per_class=8, description=_PAIRS),
    paper=f"{_PAPER} (Sec. 3.3.2)",
    summary="Per pair: hardest positive vs the closest arc of another class's pair, hinge with margin.",
    fixed={"hard_negatives": "loop"},
    judged_pairs=True,
)
register_loss(
    "loop-lifted",
    LoOpLiftedStructureLoss,
    layout=BatchLayout("classes_x_samples", classes=16, samples_per_class=2, description=_PAIRS),
    paper=f"{_PAPER} (modified Eq. 16)",
    summary="Per pair: its distance vs the closest arc of another class's pair, hinge with margin.",
    fixed={"hard_negatives": "loop"},
    judged_pairs=True,
)
register_loss(
    "loop-ms",
    LoOpMultiSimilarityLoss,
    layout=BatchLayout("classes_x_samples", classes=8, samples_per_class=4, description=_PAIRS),
    paper=f"{_PAPER} (Sec. 3.3.4)",
    summary="Multi-similarity loss whose negative similarities are the closest approach of two arcs.",
    fixed={"hard_negatives": "loop"},
    judged_pairs=True,
)
