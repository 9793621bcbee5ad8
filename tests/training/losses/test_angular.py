"""Angular loss (Wang et al., ICCV 2017): Eq. 6 (triplet), Eq. 8 (N-pair, log-sum-exp) and NL&AL (Eq. 9)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.training.losses.reference_angular import (
    angular_npair_reference,
    angular_triplet_reference,
    npair_angular_reference,
)
from training.losses import LOSSES, build_loss
from training.losses.angular import AngularLoss, NPairAngularLoss


def _batch(seed: int, labels: list[int], dim: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(len(labels), dim, generator=generator, dtype=torch.float64), torch.tensor(labels)


def _normalised(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=1)


def _shuffled_pairs(seed: int, classes: int) -> list[int]:
    labels = torch.arange(classes).repeat_interleave(2)
    return labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))].tolist()


LABEL_SETS = [
    _shuffled_pairs(0, 5),
    _shuffled_pairs(1, 7),
    [3, 3, 3, 7, 7, 1, 9, 9, 9, 9, 4, 2, 2],
    [5, 0, 5, 0, 8, 8, 8, 2],
]


def test_registry_entries() -> None:
    for name, defaults in (
        ("angular", {"alpha": 45.0, "form": "npair"}),
        ("npair-angular", {"alpha": 45.0, "lam": 2.0}),
    ):
        spec = LOSSES[name]
        assert spec.defaults == defaults
        assert spec.layout.kind == "classes_x_samples"
        assert (spec.layout.classes, spec.layout.samples_per_class) == (64, 2)
        assert spec.layout.description == "N/2 classes x 2"
    loss = build_loss("angular", alpha=36.0, form="triplet")
    assert isinstance(loss, AngularLoss) and loss.form == "triplet"
    assert loss.sq_tan_alpha == pytest.approx(math.tan(math.radians(36.0)) ** 2)
    combined = build_loss("npair-angular")
    assert isinstance(combined, NPairAngularLoss) and combined.lam == 2.0
    assert combined.npair.tuples == "all_pairs" and combined.npair.l2_reg == 0.0
    assert combined.angular.alpha == 45.0 and combined.angular.form == "npair"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("labels", LABEL_SETS)
def test_npair_form_matches_eq8_reference(seed: int, labels: list[int]) -> None:
    embeddings, label_tensor = _batch(seed, labels)
    for inputs in (embeddings, _normalised(embeddings)):
        for alpha in (36.0, 45.0):
            ours = AngularLoss(alpha=alpha)(inputs, label_tensor).item()
            expected = angular_npair_reference(inputs.tolist(), labels, alpha)
            assert ours == pytest.approx(expected, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("labels", LABEL_SETS)
def test_triplet_form_matches_eq6_reference(seed: int, labels: list[int]) -> None:
    embeddings, label_tensor = _batch(seed, labels)
    for alpha in (20.0, 45.0):
        ours = AngularLoss(alpha=alpha, form="triplet")(embeddings, label_tensor).item()
        expected = angular_triplet_reference(embeddings.tolist(), labels, alpha)
        assert expected > 0.0
        assert ours == pytest.approx(expected, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("labels", LABEL_SETS)
def test_npair_angular_matches_eq9_reference(seed: int, labels: list[int]) -> None:
    embeddings, label_tensor = _batch(seed, labels)
    ours = NPairAngularLoss(alpha=45.0, lam=2.0)(embeddings, label_tensor).item()
    expected = npair_angular_reference(embeddings.tolist(), labels, 45.0, 2.0)
    assert ours == pytest.approx(expected, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("labels", LABEL_SETS)
def test_matches_pml_on_normalised_embeddings(seed: int, labels: list[int]) -> None:
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import AngularLoss as PmlAngularLoss

    embeddings, label_tensor = _batch(seed, labels, dim=8)
    inputs = _normalised(embeddings)
    torch.testing.assert_close(
        AngularLoss(alpha=45.0)(inputs, label_tensor), PmlAngularLoss(alpha=45)(inputs, label_tensor)
    )


def test_pml_normalises_anchor_and_positive_only() -> None:
    """The intended difference on unnormalised input: pml L2-normalises x_a and x_p inside the loss but
    uses x_n as given; we use all embeddings as given (the paper normalises nothing, Section 4.4)."""
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import AngularLoss as PmlAngularLoss

    embeddings, labels = _batch(0, LABEL_SETS[1], dim=8)
    embeddings = 3.0 * embeddings
    theirs = PmlAngularLoss(alpha=45)(embeddings, labels)
    assert abs(AngularLoss(alpha=45.0)(embeddings, labels).item() - theirs.item()) > 1e-2
    # pml's value is Eq. 8 on (normalised x_a, normalised x_p, raw x_n), written out by hand:
    tan2 = math.tan(math.radians(45.0)) ** 2
    unit = _normalised(embeddings)
    anchors, positives = torch.nonzero(
        (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~torch.eye(len(labels), dtype=torch.bool),
        as_tuple=True,
    )
    f = 4 * tan2 * (unit[anchors] + unit[positives]) @ embeddings.T - 2 * (1 + tan2) * (
        unit[anchors] * unit[positives]
    ).sum(1, keepdim=True)
    negatives = labels[anchors].unsqueeze(1) != labels.unsqueeze(0)
    expected = torch.logsumexp(
        torch.cat([f.masked_fill(~negatives, float("-inf")), torch.zeros(len(f), 1, dtype=f.dtype)], 1), 1
    ).mean()
    torch.testing.assert_close(theirs, expected)


def test_eq8_drops_only_a_constant_from_eq6_on_unit_vectors() -> None:
    """Section 3.3: for ||x|| = 1, ||x_a - x_p||^2 - 4 tan^2 ||x_n - x_c||^2 = f_{a,p,n} + 2 - 6 tan^2."""
    x = _normalised(torch.randn(3, 6, dtype=torch.float64))
    xa, xp, xn = x
    t2 = math.tan(math.radians(45.0)) ** 2
    hinge_argument = (xa - xp).pow(2).sum() - 4 * t2 * (xn - (xa + xp) / 2).pow(2).sum()
    f = 4 * t2 * (xa + xp) @ xn - 2 * (1 + t2) * xa @ xp
    torch.testing.assert_close(hinge_argument, f + 2 - 6 * t2)


@pytest.mark.parametrize(
    "loss",
    [AngularLoss(45.0), AngularLoss(30.0, form="triplet"), NPairAngularLoss()],
    ids=["npair", "triplet", "npair-angular"],
)
def test_gradcheck(loss: torch.nn.Module) -> None:
    embeddings, labels = _batch(3, [0, 0, 1, 1, 2, 2, 2, 3, 4, 4], dim=4)
    assert torch.autograd.gradcheck(
        lambda x: loss(x, labels), (embeddings.requires_grad_(),), eps=1e-6, atol=1e-5
    )


def _finite_with_grad(loss: torch.nn.Module, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    embeddings = embeddings.clone().requires_grad_()
    value = loss(embeddings, labels)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(embeddings.grad).all()
    return value.detach()


@pytest.mark.parametrize(
    "loss",
    [AngularLoss(45.0), AngularLoss(45.0, form="triplet"), NPairAngularLoss()],
    ids=["npair", "triplet", "npair-angular"],
)
def test_degenerate_batches(loss: torch.nn.Module) -> None:
    x, _ = _batch(4, list(range(6)))
    for labels in ([0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]):  # single class; no positive pair
        assert _finite_with_grad(loss, x, torch.tensor(labels)).item() == 0.0
    assert _finite_with_grad(loss, x[:1], torch.tensor([0])).item() == 0.0
    assert _finite_with_grad(loss, x[:0], torch.tensor([], dtype=torch.long)).item() == 0.0
    labels = torch.tensor([0, 0, 1, 1])
    row = torch.randn(1, 6, dtype=torch.float64)
    for embeddings in (row.repeat(4, 1), torch.cat([row, row, -row, -row]), torch.zeros(4, 6), 1e3 * x[:4]):
        _finite_with_grad(loss, embeddings, labels)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="form"):
        AngularLoss(form="quadruplet")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="degrees"):
        AngularLoss(alpha=math.pi / 4 + 90.0)
