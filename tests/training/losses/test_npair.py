"""Multi-class N-pair loss (ALMN Eq. 1 / Sohn 2016) and the Angular paper's N-pair term (Eq. 10)."""

from __future__ import annotations

import pytest
import torch

from tests.training.losses.reference_npair import (
    npair_all_pairs_reference,
    npair_reference,
    sohn_tuples_reference,
)
from training.losses import LOSSES, build_loss
from training.losses.npair import NPairLoss, log1p_sum_exp, sohn_tuples
from training.losses.pairs import gram_matrix


def _batch(
    seed: int, labels: list[int], dim: int = 5, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    embeddings = scale * torch.randn(len(labels), dim, generator=generator, dtype=torch.float64)
    return embeddings, torch.tensor(labels)


def _shuffled_pairs(seed: int, classes: int) -> list[int]:
    """The "N/2 classes x 2" layout, shuffled so nothing relies on consecutive pairs."""
    labels = torch.arange(classes).repeat_interleave(2)
    return labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))].tolist()


# Two per class (shuffled), uneven classes with singletons and a class of four, non-contiguous label ids.
LABEL_SETS = [
    _shuffled_pairs(0, 6),
    _shuffled_pairs(1, 8),
    [3, 3, 3, 7, 7, 1, 9, 9, 9, 9, 4, 2, 2],
    [5, 0, 5, 0, 8, 8, 8, 2],
]


def test_registry_entry() -> None:
    spec = LOSSES["npair"]
    assert spec.defaults == {"l2_reg": 0.0005}
    assert spec.fixed == {"tuples": "sohn"}
    assert spec.layout.kind == "classes_x_samples"
    assert (spec.layout.classes, spec.layout.samples_per_class) == (64, 2)
    assert spec.layout.description == "N/2 classes x 2"
    loss = build_loss("npair", l2_reg=0.002)
    assert isinstance(loss, NPairLoss) and loss.l2_reg == 0.002 and loss.tuples == "sohn"


@pytest.mark.parametrize("labels", LABEL_SETS)
def test_sohn_tuples_are_first_two_per_class(labels: list[int]) -> None:
    anchors, positives = sohn_tuples(torch.tensor(labels))
    assert sorted(zip(anchors.tolist(), positives.tolist(), strict=True)) == sorted(
        sohn_tuples_reference(labels)
    )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("labels", LABEL_SETS)
def test_matches_reference(seed: int, labels: list[int]) -> None:
    embeddings, label_tensor = _batch(seed, labels)
    for l2_reg in (0.0, 0.0005, 0.3):
        ours = NPairLoss(l2_reg=l2_reg)(embeddings, label_tensor).item()
        assert ours == pytest.approx(npair_reference(embeddings.tolist(), labels, l2_reg), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("labels", LABEL_SETS)
def test_all_pairs_matches_angular_eq10_reference(seed: int, labels: list[int]) -> None:
    embeddings, label_tensor = _batch(seed, labels)
    ours = NPairLoss(l2_reg=0.0, tuples="all_pairs")(embeddings, label_tensor).item()
    assert ours == pytest.approx(npair_all_pairs_reference(embeddings.tolist(), labels), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("labels", LABEL_SETS)
def test_matches_pml_with_squared_l2_regulariser(seed: int, labels: list[int]) -> None:
    """Exact correspondence: our lambda/(2N) sum ||x||^2 is pml's LpRegularizer(p=2, power=2) (mean over
    the batch by its MeanReducer) with embedding_reg_weight = lambda / 2."""
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.distances import DotProductSimilarity
    from pytorch_metric_learning.losses import NPairsLoss
    from pytorch_metric_learning.regularizers import LpRegularizer

    embeddings, label_tensor = _batch(seed, labels, scale=0.7)
    l2_reg = 0.05
    theirs = NPairsLoss(
        distance=DotProductSimilarity(normalize_embeddings=False),
        embedding_regularizer=LpRegularizer(power=2),
        embedding_reg_weight=l2_reg / 2,
    )
    ours = NPairLoss(l2_reg=l2_reg)
    torch.testing.assert_close(ours(embeddings, label_tensor), theirs(embeddings, label_tensor))


def test_pml_default_lp_regulariser_is_the_unsquared_norm() -> None:
    """The documented difference: pml's default ``LpRegularizer()`` (p=2, power=1) adds w * mean ||x||, not
    Eq. 1's lambda/(2N) sum ||x||^2. The data terms are identical; only the regulariser differs."""
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.distances import DotProductSimilarity
    from pytorch_metric_learning.losses import NPairsLoss
    from pytorch_metric_learning.regularizers import LpRegularizer

    embeddings, labels = _batch(0, LABEL_SETS[1], scale=2.0)
    weight = 0.1

    def theirs(regulariser: LpRegularizer | None) -> torch.Tensor:
        loss = NPairsLoss(
            distance=DotProductSimilarity(normalize_embeddings=False),
            embedding_regularizer=regulariser,
            embedding_reg_weight=weight,
        )
        return loss(embeddings, labels)

    data = NPairLoss(l2_reg=0.0)(embeddings, labels)
    torch.testing.assert_close(theirs(None), data)
    norms = embeddings.norm(dim=1)
    torch.testing.assert_close(theirs(LpRegularizer()) - data, weight * norms.mean())
    ours_reg = NPairLoss(l2_reg=2 * weight)(embeddings, labels) - data
    torch.testing.assert_close(ours_reg, weight * norms.pow(2).mean())
    assert abs(ours_reg.item() - (theirs(LpRegularizer()) - data).item()) > 0.1  # |x| != 1 here


@pytest.mark.parametrize("tuples", ["sohn", "all_pairs"])
def test_gradcheck(tuples: str) -> None:
    embeddings, labels = _batch(3, [0, 0, 1, 1, 2, 2, 2, 3, 4, 4], dim=4)
    loss = NPairLoss(l2_reg=0.1, tuples=tuples)  # type: ignore[arg-type]
    assert torch.autograd.gradcheck(
        lambda x: loss(x, labels), (embeddings.requires_grad_(),), eps=1e-6, atol=1e-5
    )


def _finite_with_grad(loss: torch.nn.Module, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    embeddings = embeddings.clone().requires_grad_()
    value = loss(embeddings, labels)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(embeddings.grad).all()
    return value.detach()


@pytest.mark.parametrize("tuples", ["sohn", "all_pairs"])
def test_degenerate_batches(tuples: str) -> None:
    loss = NPairLoss(l2_reg=0.0, tuples=tuples)  # type: ignore[arg-type]
    x, _ = _batch(4, list(range(6)))
    for labels in ([0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]):  # single class; no positive pair
        assert _finite_with_grad(loss, x, torch.tensor(labels)).item() == 0.0
    assert _finite_with_grad(loss, x[:1], torch.tensor([0])).item() == 0.0  # a single sample
    assert _finite_with_grad(loss, x[:0], torch.tensor([], dtype=torch.long)).item() == 0.0
    # Identical, antipodal, zero and huge embeddings stay finite.
    labels = torch.tensor([0, 0, 1, 1])
    row = torch.randn(1, 6, dtype=torch.float64)
    for embeddings in (row.repeat(4, 1), torch.cat([row, row, -row, -row]), torch.zeros(4, 6), 1e3 * x[:4]):
        _finite_with_grad(loss, embeddings, labels)
    # With the L2 term a degenerate batch is exactly that term.
    value = _finite_with_grad(NPairLoss(l2_reg=0.5, tuples=tuples), x, torch.zeros(6, dtype=torch.long))  # type: ignore[arg-type]
    assert value.item() == pytest.approx(0.25 * x.pow(2).sum(1).mean().item())


def test_log1p_sum_exp_stable() -> None:
    logits = torch.tensor([[1e4, 0.0, -1e4], [5.0, 6.0, 7.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, True], [False, False, False]])
    expected = [1e4, torch.log1p(torch.tensor(5.0).exp() + torch.tensor(7.0).exp()).item(), 0.0]
    torch.testing.assert_close(log1p_sum_exp(logits, mask), torch.tensor(expected, dtype=torch.float64))


def test_rejects_unknown_tuples() -> None:
    with pytest.raises(ValueError, match="tuples"):
        NPairLoss(tuples="triplets")  # type: ignore[arg-type]


def test_gram_matrix_value_and_gradcheck() -> None:
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(gram_matrix(x), x @ x.T)
    weights = torch.randn(6, 6, dtype=torch.float64)  # a non-symmetric upstream gradient
    assert torch.autograd.gradcheck(lambda e: (gram_matrix(e) * weights).sum(), (x,))
