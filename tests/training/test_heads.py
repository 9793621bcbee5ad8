"""The PCA-initialised residual head."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from sklearn.decomposition import PCA

from training.heads import ResidualHead


def test_untrained_head_is_the_pca_projection_of_normalised_features() -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 24)).astype(np.float32) * np.linspace(3, 0.1, 24, dtype=np.float32)
    head = ResidualHead(24, out_dim=8, hidden=16)
    head.init_from_pca(features)
    unit = features / np.linalg.norm(features, axis=1, keepdims=True)
    expected = PCA(n_components=8, random_state=0).fit(unit).transform(unit)
    with torch.no_grad():
        # Scaling the input changes nothing: the head normalises first.
        got = head(torch.from_numpy(features * 5.0)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_residual_branch_starts_at_zero_but_learns() -> None:
    head = ResidualHead(12, out_dim=4, hidden=8)
    x = torch.randn(5, 12)
    assert torch.equal(head.residual(x), torch.zeros(5, 4))
    head(x).pow(2).sum().backward()
    assert head.residual[-1].weight.grad.abs().sum() > 0


def _similarity_agreement(vectors: np.ndarray, embedded: np.ndarray) -> float:
    """Correlation of the pairwise cosine similarities before and after embedding (1: same ranking)."""
    unit = [v / np.linalg.norm(v, axis=1, keepdims=True) for v in (vectors, embedded)]
    pairs = np.triu_indices(len(vectors), k=1)
    return float(np.corrcoef(*((u @ u.T)[pairs] for u in unit))[0, 1])


def test_fewer_samples_than_output_dimensions_keep_held_out_neighbours() -> None:
    # 6 training images, 48 output dimensions: PCA gives 5 rows; the other 43 must not throw away the
    # directions the training images do not span, or unseen images lose their cosine neighbours.
    rng = np.random.default_rng(1)
    train, held_out = rng.normal(size=(6, 64)), rng.normal(size=(300, 64))
    head = ResidualHead(64, out_dim=48, hidden=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: every output dimension is a full direction
        head.init_from_pca(train)
    rows = head.projection.weight.detach().double()
    # Orthogonal rows: the 5 PCA rows of unit length, the others scaled to keep the rest's energy.
    scales = torch.tensor([1.0] * 5 + [((64 - 5) / 43) ** 0.5] * 43, dtype=torch.float64)
    torch.testing.assert_close(rows @ rows.T, torch.diag(scales**2), atol=1e-5, rtol=0)
    assert torch.equal(head.projection.bias.detach(), torch.zeros(48)), (
        "a few samples' mean is not centred on"
    )
    pca_rows = PCA(n_components=5).fit(train / np.linalg.norm(train, axis=1, keepdims=True)).components_
    np.testing.assert_allclose(np.abs(rows[:5].numpy() @ pca_rows.T), np.eye(5), atol=1e-5)
    with torch.no_grad():
        embedded = head(torch.as_tensor(held_out, dtype=torch.float32)).numpy()
    unit = held_out / np.linalg.norm(held_out, axis=1, keepdims=True)
    pca_only = unit @ pca_rows.T  # the previous init: these rows, the others scaled by 1e-2
    kept, before = _similarity_agreement(held_out, embedded), _similarity_agreement(held_out, pca_only)
    assert kept > 0.7 and kept > before + 0.4, (kept, before)
