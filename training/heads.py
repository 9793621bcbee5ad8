"""The embedding head trained on top of the backbone's pooled features.

Measured on Cars196 before this module existed: a randomly initialised linear 1280->512 head *lowered*
unseen-class Recall@1 (60.7 -> 54-57), while a head that starts as the PCA projection of the training
features, plus a zero-initialised residual MLP, raised it (to 70.8). The reason: at step 0 the PCA head
already is a good retrieval model (it keeps the directions the features vary most in), so training starts
from the pretrained quality instead of from a random projection that the loss must first undo.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.decomposition import PCA
from torch import nn

NORMALIZE_EPS = 1e-12  # F.normalize's default: norms below it are taken as it


class ResidualHead(nn.Module):
    """``x -> P(x / |x|) + MLP(x / |x|)``: a linear projection (PCA-initialised) plus a residual MLP.

    The MLP's last layer starts at zero, so the untrained head *is* the PCA projection. Input features
    are L2-normalised first: the frozen feature cache holds unit vectors, and normalising here makes the
    exported graph (backbone -> head) compute the same function from the raw pooled features.
    The output is not normalised (some losses use the norm); the search model normalises after the head.
    """

    def __init__(self, in_dim: int, out_dim: int = 512, hidden: int = 1024) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.hidden = in_dim, out_dim, hidden
        self.projection = nn.Linear(in_dim, out_dim)
        first, last = nn.Linear(in_dim, hidden), nn.Linear(hidden, out_dim)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.residual = nn.Sequential(first, nn.ReLU(), last)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = F.normalize(features, dim=1, eps=NORMALIZE_EPS)
        return self.projection(x) + self.residual(x)

    def split(self, features: torch.Tensor, parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(features)`` split exactly over ``parts`` (n, P, in_dim), which sum to ``features``.

        Returns ``(shares, rest)``, (n, P, out_dim) and (n, out_dim), with ``shares.sum(1) + rest ==
        forward(features)``. The head is piecewise linear: with the input's norm and the ReLU gates held at
        their values for ``features``, it is the affine map ``A x + c`` it computes there, so each part gets
        ``A part / |features|`` (the gradient times the part) and ``rest`` is ``c``, the biases passed by the
        open gates: what no position of the image carries.
        """
        scale = 1 / features.norm(dim=1, keepdim=True).clamp_min(NORMALIZE_EPS)
        first, _, last = self.residual
        assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)  # the layers __init__ made
        gates = (first(features * scale) > 0).to(features.dtype)
        scaled_parts = parts * scale[:, :, None]
        hidden = F.linear(scaled_parts, first.weight) * gates[:, None, :]
        shares = F.linear(scaled_parts, self.projection.weight) + F.linear(hidden, last.weight)
        rest = self.projection.bias + F.linear(gates * first.bias, last.weight, last.bias)
        return shares, rest

    @torch.no_grad()
    def init_from_pca(self, features: np.ndarray, seed: int = 0) -> None:
        """Set the projection to the PCA of the (normalised) training features: ``W (x - mean)``.

        With fewer samples than output dimensions PCA gives only k <= n-1 rows, and a head that keeps
        little more than those throws away what the backbone knows about unseen images: on 36- and 96-image
        Cars196 folders the old init (other rows 1e-2-scaled random) lost 6-13 Recall@1 points to the raw
        backbone on average, this one under 2 (bench/results/head_init.md). So the PCA rows are completed
        to an orthonormal basis with random directions orthogonal to them, scaled by
        ``sqrt((in_dim - k) / (out_dim - k))``: a Johnson-Lindenstrauss projection of the rest that keeps
        its expected energy, so held-out cosine similarities are kept on average. Such a head is not
        centred: the mean of a few training classes is not that of the images it will embed (centring
        measured no better). With enough samples nothing changes.
        """
        x = features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
        components = min(self.out_dim, len(x) - 1, self.in_dim)
        pca = PCA(n_components=components, random_state=seed).fit(x)
        rest = orthonormal_completion(pca.components_, self.out_dim, seed)
        centre = components == self.out_dim
        if not centre:
            rest *= np.sqrt((self.in_dim - components) / max(len(rest), 1))
        # Rows beyond in_dim (a head wider than its input) cannot be orthogonal: they start at zero.
        extra = np.zeros((self.out_dim - components - len(rest), self.in_dim), rest.dtype)
        weight, bias = self.projection.weight, self.projection.bias
        weight.copy_(torch.as_tensor(np.concatenate([pca.components_, rest, extra]), dtype=weight.dtype))
        if centre:
            bias.copy_(-weight @ torch.as_tensor(pca.mean_, dtype=weight.dtype))
        else:
            bias.zero_()


def orthonormal_completion(basis: np.ndarray, rows: int, seed: int = 0) -> np.ndarray:
    """Random unit rows, orthonormal and orthogonal to the orthonormal ``basis``, that complete it to
    ``rows`` rows (or to a basis of the whole space, if that has fewer dimensions)."""
    missing = min(rows, basis.shape[1]) - len(basis)
    if missing <= 0:
        return np.zeros((0, basis.shape[1]), basis.dtype)
    random = np.random.default_rng(seed).normal(size=(basis.shape[1], missing))
    random -= basis.T @ (basis @ random)  # remove the basis's span, then orthonormalise what is left
    random -= basis.T @ (basis @ random)  # twice: one pass leaves float error of the size of the basis
    return np.linalg.qr(random)[0].T.astype(basis.dtype)
