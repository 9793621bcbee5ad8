"""ALMN: Adaptive Large Margin N-pair loss with geometrical Virtual Point Generating.

Chen & Deng, "ALMN: Deep Embedding Learning with Geometrical Virtual Point Generating", ECCV 2018.

Per sample x_i with class centre c = c_{y_i} as the anchor (Section 3.2):

* theta_i  = angle(x_i, c); theta_nn = angle(x_nn, c) for the batch sample x_nn of another class nearest
  (in angle) to c (Section 3.3, "Adaptive Margin");
* lower-bound vector, Eq. 6:  b_L = ||x_i|| sqrt(2 - 2 cos(theta_nn - theta_i)) (x_i - c) / ||x_i - c||;
* virtual point, Eq. 7:       x_g = (beta b_L + x_i) / ||beta b_L + x_i|| * ||x_i||
                                  = ((M + 1) x_i - M c) / ||(M + 1) x_i - M c|| * ||x_i||,
  M = beta ||x_i|| sqrt(2 - 2 cos(theta_nn - theta_i)) / ||x_i - c||;
* loss, Eq. 8:  L = -1/N sum_i log( e^{x_g^T c} / (e^{x_g^T c} + sum_{y_j != y_i} e^{x_j^T c}) )
                    + lambda/(2N) sum_i ||x_i||^2;
* centres, Eq. 2 (after the loss, Algorithm 1 step 7; not by gradient):
      c_z <- c_z - alpha sum_i 1{y_i = z} (c_z - x_i) / (1 + sum_i 1{y_i = z}).

beta = 0 gives x_g = x_i, the paper's baseline (Eq. 3).
"""

from __future__ import annotations

from typing import Any

import torch

from foundation.errors import InvalidInputError
from training.losses.base import MetricLoss
from training.losses.npair import l2_term, log1p_sum_exp
from training.losses.registry import BatchLayout, register_loss

# Keeps acos's derivative finite at cos = +-1 (identical or antipodal directions).
_COS_EPS = 1e-7
# Below this ||x_i - c|| the direction of b_L is undefined; the virtual point is then x_i itself.
_DIST_EPS = 1e-12


class ALMNLoss(MetricLoss):
    """Adaptive Large Margin N-pair loss (Eq. 8) with class centres updated by Eq. 2.

    Centres: a buffer ``centres`` (num_classes, d) with a boolean buffer ``seen``; both move with the
    module and are saved in its ``state_dict``. The number of classes is not a constructor argument:
    the buffers grow to ``max(label) + 1`` rows the first time a larger label appears (labels must be
    non-negative integers), and loading a ``state_dict`` adopts its shapes. Centres are float32 (float64
    for float64 embeddings).

    A class seen for the first time has no centre yet; it is initialised to the mean of its samples in
    the batch, used as the anchor for that batch, and stored. Eq. 2 then leaves it unchanged (the
    summed residual to the batch mean is zero), so the first update is exactly this initialisation.
    Eq. 2 runs in training mode only, after the loss and on detached embeddings; in eval mode the
    module never changes its buffers (unseen classes use their batch mean transiently), which also
    makes it a pure function for ``gradcheck``.

    ``center_lr`` is Eq. 2's alpha. The paper reuses "alpha" for the network learning rate (1e-5,
    Section 5.1) and gives no separate value; 0.5 is the centre learning rate of the centre loss it
    follows for this update (Wen et al., ECCV 2016, its ref. [35]).

    Hard patterns, theta_nn <= theta_i (the nearest negative is closer to the centre than x_i is): the
    paper wants "weaker constraint" for hard patterns and defines the margin angle theta* = theta_nn -
    theta_i, which is then <= 0. sqrt(2 - 2 cos(theta*)) is even in theta*, so Eq. 6 as written would
    push a hard x_i further out the harder it is; instead theta* is clamped at 0, i.e. no virtual
    margin (M = 0, x_g = x_i) and the hard sample is trained by the plain centre N-pair term of Eq. 3.
    The margin is continuous in theta* at the switch. The same applies without any negative in the
    batch (whose data term is 0 anyway).

    Gradient: autograd through everything, including theta_i and theta_nn inside M (and so through the
    nearest negative). The paper's Eq. 11 (as we read it) differentiates M through ||x_i|| and ||x_i - c||,
    treating sqrt(2 - 2 cos(theta_nn - theta_i)) as a constant; we keep the exact gradient of the
    loss so it is gradcheck-able. ``sqrt(2 - 2 cos t)`` is evaluated as ``2 sin(t / 2)`` (t >= 0), which
    has a finite derivative at t = 0.

    Degenerate inputs: a single class or a single sample (no negative) gives a data term of exactly 0
    (connected to the input), so the loss is the L2 term alone; an empty batch gives a connected 0;
    x_i = c gives x_g = x_i; cosines are clamped before acos, so identical or antipodal inputs stay
    finite.
    """

    centres: torch.Tensor
    seen: torch.Tensor

    # beta = 3 gives the paper's best results (Tables 2-4); lambda = 0.0005 (Section 5.1).
    def __init__(self, beta: float = 3.0, l2_reg: float = 0.0005, center_lr: float = 0.5) -> None:
        super().__init__()
        if beta < 0:
            raise InvalidInputError(f"beta must be >= 0, got {beta}")
        self.beta = beta
        self.l2_reg = l2_reg
        self.center_lr = center_lr
        self.register_buffer("centres", torch.zeros(0, 0))
        self.register_buffer("seen", torch.zeros(0, dtype=torch.bool))

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        if len(labels) == 0:
            return embeddings.sum() * 0.0
        if int(labels.min()) < 0:
            raise ValueError("ALMN labels index the centre buffer and must be >= 0")
        classes, index = torch.unique(labels, return_inverse=True)  # batch class k, sample -> k
        x = embeddings.detach()
        sums = x.new_zeros(len(classes), x.shape[1]).index_add_(0, index, x)
        counts = torch.bincount(index, minlength=len(classes)).to(x.dtype).unsqueeze(1)
        centres = self._batch_centres(classes, sums / counts)

        loss = self._loss(embeddings, index, centres)
        if self.training:
            # Eq. 2, c_z - alpha (n_z c_z - sum_{y_i = z} x_i) / (1 + n_z), for the batch's classes.
            updated = centres - self.center_lr * (counts * centres - sums) / (1.0 + counts)
            self.centres[classes] = updated.to(self.centres.dtype)
            self.seen[classes] = True
        return loss

    def _loss(self, embeddings: torch.Tensor, index: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        """Eq. 8 given each batch class's anchor centre (constant: centres get no gradient)."""
        sims = embeddings @ centres.T  # (B, K): x_j^T c_k
        norms = embeddings.norm(dim=1)
        cos = sims / (norms.unsqueeze(1) * centres.norm(dim=1).unsqueeze(0)).clamp_min(_DIST_EPS)
        negative = index.unsqueeze(1) != index.unsqueeze(0)  # [i, j]: y_j != y_i
        negative_sims = sims.index_select(1, index).T  # [i, j] = x_j^T c_{y_i}

        # theta_nn per batch class: the smallest angle to its centre among the other classes' samples
        # (cos 1, i.e. theta_nn = 0 and so no margin, for a class without negatives in the batch).
        other_class = index.unsqueeze(1) != torch.arange(len(centres), device=index.device)  # (B, K)
        cos_nn = cos.masked_fill(~other_class, -1.0).amax(0)
        cos_nn = torch.where(other_class.any(0), cos_nn, 1.0).index_select(0, index)
        cos_i = cos.gather(1, index.unsqueeze(1)).squeeze(1)
        theta_i = torch.acos(cos_i.clamp(-1.0 + _COS_EPS, 1.0 - _COS_EPS))
        theta_nn = torch.acos(cos_nn.clamp(-1.0 + _COS_EPS, 1.0 - _COS_EPS))
        theta_star = torch.relu(theta_nn - theta_i)  # hard patterns (theta_nn <= theta_i): no margin
        bound = 2.0 * torch.sin(0.5 * theta_star)  # sqrt(2 - 2 cos(theta_nn - theta_i)), Eq. 6

        # Eq. 6-7: x_g = (x_i + beta ||x_i|| bound u) / ||.|| * ||x_i||, u = (x_i - c)/||x_i - c||.
        own_centres = centres[index]
        residual = embeddings - own_centres
        distance = residual.norm(dim=1, keepdim=True)
        defined = distance > _DIST_EPS
        # Where x_i = c, u is undefined: use u = 0 (x_g = x_i) with a safe divisor so no inf reaches grad.
        direction = torch.where(defined, residual / torch.where(defined, distance, 1.0), 0.0)
        v = embeddings + (self.beta * norms * bound).unsqueeze(1) * direction
        g_sims = (v * own_centres).sum(1) * norms / v.norm(dim=1).clamp_min(_DIST_EPS)  # x_g^T c

        data = log1p_sum_exp(negative_sims - g_sims.unsqueeze(1), negative).mean()
        return data + l2_term(embeddings, self.l2_reg)

    def _batch_centres(self, classes: torch.Tensor, batch_means: torch.Tensor) -> torch.Tensor:
        """Stored centres of the batch's classes; unseen classes get their batch mean (see class doc).

        Only training mode grows the buffers, so eval mode reads them without changing anything.
        """
        if self.training:
            self._grow(int(classes.max()) + 1, batch_means)
        in_buffer = classes < len(self.seen)
        stored = torch.zeros_like(in_buffer)
        stored[in_buffer] = self.seen[classes[in_buffer]]
        centres = batch_means.clone()
        if stored.any():
            centres[stored] = self.centres[classes[stored]].to(centres.dtype)
        return centres

    def _grow(self, num_classes: int, like: torch.Tensor) -> None:
        rows, dim = self.centres.shape
        if rows and dim != like.shape[1]:
            raise ValueError(f"ALMN centres have dimension {dim}, embeddings {like.shape[1]}")
        if rows and num_classes <= rows:
            return
        dtype = torch.promote_types(torch.float32, like.dtype)
        centres = like.new_zeros(max(num_classes, rows), like.shape[1], dtype=dtype)
        seen = torch.zeros(len(centres), dtype=torch.bool, device=like.device)
        if rows:
            centres[:rows] = self.centres.to(centres)
            seen[:rows] = self.seen.to(seen.device)
        self.centres, self.seen = centres, seen

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # The buffers grow with the labels seen, so take the saved shapes before the default copy.
        for name in ("centres", "seen"):
            saved = state_dict.get(prefix + name)
            if saved is not None:
                setattr(self, name, torch.empty_like(saved, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


register_loss(
    "almn",
    ALMNLoss,
    # Section 5.2: m x n = 26 classes x 5 samples works best and is used for all further experiments.
    layout=BatchLayout("classes_x_samples", 26, 5, "26 classes x 5"),
    paper="Chen & Deng, ALMN: Deep Embedding Learning with Geometrical Virtual Point Generating, ECCV 2018",
    summary="N-pair loss anchored at class centres (updated per batch by Eq. 2) with an adaptive angular "
    "margin from a virtual point generated away from the centre (Eq. 6-8).",
)
