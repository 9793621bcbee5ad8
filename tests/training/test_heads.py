"""The PCA-initialised residual head."""

from __future__ import annotations

import numpy as np
import pytest
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


def test_fewer_samples_than_output_dimensions() -> None:
    features = np.random.default_rng(1).normal(size=(6, 20)).astype(np.float32)
    head = ResidualHead(20, out_dim=10, hidden=8)
    with pytest.warns(UserWarning, match="gives 5 of 10"):
        head.init_from_pca(features)
    rows = head.projection.weight.detach()
    assert torch.all(rows.norm(dim=1) > 0), "every output dimension gets a direction (and so gradient)"
