"""Position-Dependent Deep Metric (PDDM) unit and its joint metric + embedding loss.

Huang, Loy, Tang, "Local Similarity-Aware Deep Feature Embedding", NIPS 2016.

* :class:`PDDMUnit` is the learnable similarity score S(i, j) of Eq. 2. Its :meth:`PDDMUnit.score`
  re-ranks candidates for a query at search time.
* :class:`PDDMLoss` owns a :class:`PDDMUnit` as a submodule (train its parameters with the embedding
  head) and implements the hard-quadruplet mining and the double-header hinge on scores (Eq. 3) plus the
  double-header hinge on features (Eq. 4): ``E_m + lambda E_e``.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn
from torch.nn import functional as F

from foundation.errors import InvalidInputError
from training.losses.base import MetricLoss
from training.losses.pairs import pair_masks
from training.losses.registry import BatchLayout, register_loss

Quadruplets = Literal["batch", "per_class", "per_sample"]

# The batch graph's score range is 0 only when every pair scores the same (e.g. all embeddings coincide,
# or every ReLU of the unit is dead); the floor keeps the [0, 1] scaling finite there (scores then map to 0).
_RANGE_EPS = 1e-12
# Elements of the largest (pairs x width) intermediate the mining pass holds at once (64 MiB in float32).
_GRAPH_BLOCK_ELEMENTS = 1 << 24
# Row blocks of the graph pass: with k blocks, (k + 1) / 2k of the B^2 pairs are scored. Up to 8 blocks,
# but not below 32 rows, where the per-call overhead outweighs the pairs saved.
_GRAPH_BLOCKS, _GRAPH_MIN_ROWS = 8, 32


def _inverse_norm(x: torch.Tensor) -> torch.Tensor:
    """``1 / max(|x|_2, 1e-12)`` over the last dimension (keepdim), as in ``F.normalize``: 0 stays 0."""
    return x.norm(dim=-1, keepdim=True).clamp_min(1e-12).reciprocal()


class PDDMUnit(nn.Module):
    """The PDDM unit, Eq. 2 (Huang et al. 2016, Section 3.1, Figure 2b)::

        u = |f_i - f_j|,  v = (f_i + f_j) / 2            (f on the unit hypersphere)
        u' = r(sigma(W_u u + b_u)),  v' = r(sigma(W_v v + b_v))
        c = sigma(W_c [u'; v'] + b_c),  S_ij = W_s c + b_s

    with sigma = ReLU and r(x) = x / |x|_2. The score is linear at the end (no final nonlinearity: the
    loss scales it into [0, 1] over the batch graph). The paper's layers are square, ``W_u, W_v`` d x d,
    ``W_c`` 2d x d; ``hidden`` sets that width (``hidden = dim`` is the paper's literal shape).

    S is symmetric: u and v are, bit for bit (``|a - b| == |b - a|``, and the v branch adds the two
    projections). ``W_v v`` is computed as ``(W_v f_i + W_v f_j) / 2``: with broadcast inputs each side is
    projected once, so only the u branch is paid per pair.

    Dropout (the paper puts p = 0.5 after the FC layers, Section 3.3) acts on the ReLU outputs of the three
    hidden layers, before the l2 normalisations of u' and v'. It is applied only through explicit ``masks``
    from :meth:`sample_dropout`: one mask per hidden unit shared by every pair of a batch, so that mining,
    the graph's scaling and the hinge all see the same thinned unit (see :class:`PDDMLoss`).
    """

    def __init__(self, dim: int, hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        if dim < 1 or hidden < 1:
            raise InvalidInputError(f"dim and hidden must be positive, got {dim}, {hidden}")
        if not 0.0 <= dropout < 1.0:
            raise InvalidInputError(f"dropout must be in [0, 1), got {dropout}")
        self.dim, self.hidden, self.dropout = dim, hidden, dropout
        self.fc_u = nn.Linear(dim, hidden)
        self.fc_v = nn.Linear(dim, hidden)
        self.fc_c = nn.Linear(2 * hidden, hidden)
        self.fc_s = nn.Linear(hidden, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """S(a, b) over the last dimension, broadcasting the rest: (..., d), (..., d) -> (...).

        ``masks``: (3, hidden) dropout masks for the u, v and c layers, or None for the full unit.
        """
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
        w_u: torch.Tensor = self.fc_u.weight
        b_u: torch.Tensor = self.fc_u.bias
        w_v: torch.Tensor = self.fc_v.weight
        b_v: torch.Tensor = self.fc_v.bias
        w_s = self.fc_s.weight
        if masks is not None:
            # A non-negative mask commutes with ReLU: scaling the rows of a layer (columns of W_s for c)
            # drops its units for every pair at no per-pair cost.
            w_u, b_u = w_u * masks[0].unsqueeze(1), b_u * masks[0]
            w_v, b_v = w_v * masks[1].unsqueeze(1), b_v * masks[1]
            w_s = w_s * masks[2]
        h_u = F.relu(F.linear(torch.sub(a, b).abs_(), w_u, b_u), inplace=True)
        # W_v v + b_v = (W_v a + b_v)/2 + (W_v b + b_v)/2: each side is projected before broadcasting.
        h_v = F.relu(F.linear(a, w_v, b_v) / 2 + F.linear(b, w_v, b_v) / 2, inplace=True)
        # W_c [r(h_u); r(h_v)] = W_c^u h_u / |h_u| + W_c^v h_v / |h_v|: no normalised copies, no concat.
        w_cu, w_cv = self.fc_c.weight.split(self.hidden, dim=1)
        c = torch.addcmul(self.fc_c.bias, F.linear(h_u, w_cu), _inverse_norm(h_u))
        c = F.relu(c.addcmul_(F.linear(h_v, w_cv), _inverse_norm(h_v)), inplace=True)
        return F.linear(c, w_s, self.fc_s.bias).squeeze(-1)

    def score(self, queries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """PDDM scores for re-ranking: queries (q, d) against their candidates (q, k, d), or against a
        shared candidate set (k, d); returns (q, k), higher = more similar.

        Uses the full unit (no dropout); call it under ``torch.inference_mode()`` at query time. Memory is
        O(q k d): chunk the queries for large shortlists.
        """
        if candidates.ndim == 2:
            candidates = candidates.unsqueeze(0)
        return self(queries.unsqueeze(1), candidates)

    def similarity_graph(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """The batch similarity graph: S for every pair of rows of x, a symmetric (B, B) matrix.

        Only the upper triangle is evaluated, in blocks of rows (a block against the columns from its first
        row on, then mirrored; 8 blocks score 56% of the B^2 pairs), each small enough that the (rows x B x d)
        difference tensor stays near ``_GRAPH_BLOCK_ELEMENTS``. The diagonal holds the self scores S(i, i).
        """
        size = len(x)
        budget = _GRAPH_BLOCK_ELEMENTS // (size * max(self.dim, 2 * self.hidden))
        rows = max(1, min(budget, max(_GRAPH_MIN_ROWS, -(-size // _GRAPH_BLOCKS))))
        graph = x.new_zeros(size, size)
        for start in range(0, size, rows):
            stop = min(start + rows, size)
            graph[start:stop, start:] = self(x[start:stop].unsqueeze(1), x[start:].unsqueeze(0), masks)
        return graph.triu() + graph.triu(1).T

    def sample_dropout(self, like: torch.Tensor) -> torch.Tensor | None:
        """Fresh (3, hidden) inverted-dropout masks in ``like``'s dtype/device; None in eval mode or p = 0."""
        if not self.training or self.dropout == 0.0:
            return None
        keep = 1.0 - self.dropout
        return torch.bernoulli(like.new_full((3, self.hidden), keep)) / keep


@torch.no_grad()
def hard_quadruplets(
    graph: torch.Tensor,
    labels: torch.Tensor,
    quadruplets: Quadruplets = "batch",
    batch_info: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hard quadruplets (i^, j^, k^, l^) of Eq. 3 mined on a (B, B) similarity graph, as index tensors.

    ``(i^, j^) = argmin_{(i,j) in P} S_ij`` (the least similar positive pair),
    ``k^ = argmax_{(i^,k) in N} S_i^k`` and ``l^ = argmax_{(j^,l) in N} S_j^l`` (their most similar
    negatives). ``quadruplets`` says where the argmin runs: ``"batch"``, one quadruplet (the paper's);
    ``"per_class"``, one per class that has a positive pair (over that class's pairs); ``"per_sample"``, one
    per sample i^ that has a positive (over i^'s own pairs). Classes or samples without a positive pair,
    or a batch without any negative pair, yield none (empty tensors). Ties go to the first index. The pairs
    are the labels' and the judged ones of ``batch_info`` (:func:`~training.losses.pairs.pair_masks`); a
    hardest positive pair one of whose members has no negative yields none either.
    """
    positive, negative = pair_masks(labels, batch_info or {})
    inf = torch.tensor(float("inf"), dtype=graph.dtype, device=graph.device)
    positive_scores = torch.where(positive, graph, inf)
    hardest_positive = positive_scores.argmin(dim=1)  # each sample's least similar positive
    row_min = positive_scores.gather(1, hardest_positive.unsqueeze(1)).squeeze(1)
    if quadruplets == "per_sample":
        groups = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    elif quadruplets == "per_class":
        groups = labels.unique().unsqueeze(1) == labels.unsqueeze(0)  # (C, B)
    else:
        groups = torch.ones(1, len(labels), dtype=torch.bool, device=labels.device)
    candidates = torch.where(groups, row_min, inf)
    i_hat = candidates.argmin(dim=1)
    j_hat = hardest_positive[i_hat]
    valid = torch.isfinite(candidates.gather(1, i_hat.unsqueeze(1)).squeeze(1))
    valid &= negative[i_hat].any(1) & negative[j_hat].any(1)
    i_hat, j_hat = i_hat[valid], j_hat[valid]
    negative_scores = torch.where(negative, graph, -inf)
    return i_hat, j_hat, negative_scores[i_hat].argmax(dim=1), negative_scores[j_hat].argmax(dim=1)


@torch.no_grad()
def graph_extremes(graph: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)``, each (2,): the graph's least similar pair (i != j) is ``(rows[0], cols[0])``, its
    most similar ``(rows[1], cols[1])``."""
    size = len(graph)
    off_diagonal = ~torch.eye(size, dtype=torch.bool, device=graph.device)
    inf = torch.tensor(float("inf"), dtype=graph.dtype, device=graph.device)
    low = torch.where(off_diagonal, graph, inf).argmin()
    high = torch.where(off_diagonal, graph, -inf).argmax()
    flat = torch.stack((low, high))
    return flat // size, flat % size


class PDDMLoss(MetricLoss):
    """Joint PDDM metric and embedding loss, Eqs. 3 and 4 (Huang et al. 2016)::

        L = 1/Q sum_q [ E_m + lambda E_e ]
        E_m = [alpha + S~_i^k^ - S~_i^j^]_+ + [alpha + S~_j^l^ - S~_i^j^]_+                      (Eq. 3)
        E_e = [beta + D_i^j^ - D_i^k^]_+ + [beta + D_i^j^ - D_j^l^]_+                           (Eq. 4)

    over the hard quadruplets (i^, j^, k^, l^) of :func:`hard_quadruplets` (Q = 1 with ``quadruplets=
    "batch"``, the paper's one per batch; Q = number of classes, or of samples, with a positive pair for
    ``"per_class"`` or ``"per_sample"``),
    with S from the owned :class:`PDDMUnit` (``self.unit``) and D on the l2-normalised embeddings. The
    weight decay gamma |W|^2 of Eq. 4 is the optimiser's job (paper: 5e-4). Paper values: alpha = 0.5,
    beta = 1, lambda = 0.5, batches of m = 64 with >= 4 samples per class.

    Choices where the paper is open:

    * "We always scale S into the range [0, 1] by the similarity graph in the batch" (Section 3.3) is read
      as min-max scaling over the complete batch graph, every pair i != j:
      ``S~ = (S - min S) / (max S - min S)``. The min and max carry gradient (like the mined scores, they
      are selected without it): the scaled loss is then invariant to an affine rescaling of the scores, so
      the margin alpha cannot be met by inflating ``W_s``.
    * D is the *squared* Euclidean distance ``|f_a - f_b|^2 = 2 - 2 f_a . f_b``: Eq. 4 writes
      ``D = |f_a - f_b|_2`` but expands ``beta + D_ij - D_ik`` as ``beta - 2 f_i f_j + 2 f_i f_k``, the
      squared form of the triplet methods it cites, which is also free of sqrt singularities.
    * ``hidden`` defaults to 128: Eq. 2's layers are d wide and the paper's retrieval embedding is
      d = 128. Set ``hidden=embedding_dim`` for the literal shape at other d.
    * Dropout (p = 0.5 in the paper) samples one mask per hidden unit per batch, shared by all pairs
      (:meth:`PDDMUnit.sample_dropout`), so the scores mined, scaled and penalised are one function.
    * The paper's one quadruplet per batch gives the embedding two hinge terms per step. ``"per_class"`` and
      ``"per_sample"`` mine the same way within each class or for each sample, so a batch teaches more
      (Cars196 frozen features: validation R@1 peaked at 72.3 with one per batch, 75.6 with one per sample).

    Cost: mining needs the scores of all B(B-1)/2 pairs (for the graph's min and max); that pass runs without
    autograd in row blocks (memory O(block x B x d)). Only the 3Q + 2 selected pairs are re-scored with
    gradient: argmin/argmax and min/max send gradient to the selected pairs only, so this is the gradient of
    the loss through the full graph (away from exact ties), at O(B^2) forward-only cost.

    Degenerate batches (a single sample, a single class, no positive pair) have no quadruplet: the loss is a
    defined zero connected to the embeddings and to the unit's parameters. If all pairs score the same, the
    graph's range is floored at 1e-12 and every scaled score is 0 (finite loss).
    """

    def __init__(
        self,
        embedding_dim: int = 128,
        hidden: int = 128,
        dropout: float = 0.5,
        alpha: float = 0.5,
        beta: float = 1.0,
        lam: float = 0.5,
        quadruplets: Quadruplets = "batch",
    ) -> None:
        super().__init__()
        if quadruplets not in get_args(Quadruplets):
            raise InvalidInputError(
                f"quadruplets must be one of {get_args(Quadruplets)}, got {quadruplets!r}"
            )
        self.unit = PDDMUnit(embedding_dim, hidden, dropout)
        self.alpha, self.beta, self.lam = alpha, beta, lam
        self.quadruplets = quadruplets

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        if embeddings.ndim != 2 or len(embeddings) != len(labels) or embeddings.shape[1] != self.unit.dim:
            raise ValueError(
                f"expected (B, {self.unit.dim}) embeddings and B labels, "
                f"got {tuple(embeddings.shape)}, {len(labels)}"
            )
        masks = self.unit.sample_dropout(embeddings)
        with torch.no_grad():
            graph = self.unit.similarity_graph(embeddings, masks)
        i_hat, j_hat, k_hat, l_hat = hard_quadruplets(graph, labels, self.quadruplets, batch_info)
        if len(i_hat) == 0:
            connected = sum(p.sum() for p in self.unit.parameters())
            return (embeddings.sum() + connected) * 0.0

        rows, cols = graph_extremes(graph)
        n = len(i_hat)
        # Re-score with gradient only the selected pairs: (i^,j^), (i^,k^), (j^,l^), the graph's min and max.
        first = torch.cat((i_hat, i_hat, j_hat, rows))
        second = torch.cat((j_hat, k_hat, l_hat, cols))
        scores = self.unit(embeddings[first], embeddings[second], masks)
        s_ij, s_ik, s_jl, (s_min, s_max) = scores.split([n, n, n, 2])
        scale = (s_max - s_min).clamp_min(_RANGE_EPS)
        s_ij, s_ik, s_jl = (s_ij - s_min) / scale, (s_ik - s_min) / scale, (s_jl - s_min) / scale
        metric = F.relu(self.alpha + s_ik - s_ij) + F.relu(self.alpha + s_jl - s_ij)

        f = F.normalize(embeddings, dim=1)
        d_ij, d_ik, d_jl = (
            (f[a] - f[b]).pow(2).sum(1) for a, b in ((i_hat, j_hat), (i_hat, k_hat), (j_hat, l_hat))
        )
        embedding = F.relu(self.beta + d_ij - d_ik) + F.relu(self.beta + d_ij - d_jl)
        return (metric + self.lam * embedding).mean()


register_loss(
    "pddm",
    PDDMLoss,
    layout=BatchLayout(
        "classes_x_samples", classes=16, samples_per_class=4, description="16 classes x 4 (>= 4 per class)"
    ),
    paper="Huang, Loy, Tang, Local Similarity-Aware Deep Feature Embedding, NIPS 2016 (Eqs. 2-4)",
    summary="PDDM: a learned position-dependent similarity unit mines one hard quadruplet per batch "
    "(least similar positive pair, each member's most similar negative); double-header hinges on the "
    "[0, 1]-scaled scores and on the embedding distances.",
    judged_pairs=True,
)
