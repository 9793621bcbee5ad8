"""Baseline losses: plain-loop references, gradcheck, pytorch-metric-learning parity, degenerate batches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.training.losses.reference_baselines import (
    contrastive_reference,
    hphn_reference,
    lifted_reference,
    ms_reference,
    normalize,
    triplet_reference,
)
from training.losses import LOSSES, build_loss
from training.losses.baselines import ContrastiveLoss, masked_logsumexp

NAMES = ["contrastive", "triplet", "hphn-triplet", "lifted", "ms"]

# Non-default hyperparameters exercised next to the defaults.
OTHER_HPARAMS = {
    "contrastive": {"pos_margin": 0.3, "neg_margin": 1.2, "power": 1.0},
    "triplet": {"margin": 0.5},
    "hphn-triplet": {"margin": 0.05},
    "lifted": {"neg_margin": 0.4, "pos_margin": 0.2},
    "ms": {"alpha": 3.0, "beta": 20.0, "base": 0.3, "epsilon": 0.3},
}


def reference(name: str, embeddings: torch.Tensor, labels: torch.Tensor, **hparams: float) -> float:
    hp = {**LOSSES[name].defaults, **hparams}
    rows = embeddings.tolist()
    rows = normalize(rows) if hp.pop("normalize") else rows
    labs = labels.tolist()
    if name == "contrastive":
        return contrastive_reference(rows, labs, hp["pos_margin"], hp["neg_margin"], hp["power"])
    if name == "triplet":
        return triplet_reference(rows, labs, hp["margin"])
    if name == "hphn-triplet":
        return hphn_reference(rows, labs, hp["margin"])
    if name == "lifted":
        return lifted_reference(rows, labs, hp["pos_margin"], hp["neg_margin"])
    return ms_reference(rows, labs, hp["alpha"], hp["beta"], hp["base"], hp["epsilon"])


def balanced_batch(
    seed: int, classes: int, per_class: int, dim: int, shuffle: bool = False, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    if shuffle:
        labels = labels[torch.randperm(len(labels), generator=gen)]
    # class means make the batch partly separated, so hinges and mining are neither all on nor all off
    means = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    x = means[labels] + 0.8 * torch.randn(len(labels), dim, generator=gen, dtype=torch.float64)
    return (scale * x).requires_grad_(), labels


BATCHES = {
    "4x3": lambda: balanced_batch(0, 4, 3, 5),
    "3x4-shuffled": lambda: balanced_batch(1, 3, 4, 6, shuffle=True, scale=3.0),
    "2x2": lambda: balanced_batch(2, 2, 2, 4),
    # unbalanced: anchors with 4, 1 and 0 positives (singleton class 9), padded triplet blocks
    "unbalanced": lambda: (
        torch.randn(11, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64).requires_grad_(),
        torch.tensor([0, 0, 0, 0, 0, 1, 1, 9, 2, 2, 2]),
    ),
}


# ---------------------------------------------------------------------------------------------------
# 1. Equal to the plain-loop references
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("other", [False, True], ids=["defaults", "other-hparams"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name: str, other: bool, batch: str) -> None:
    x, labels = BATCHES[batch]()
    hparams = OTHER_HPARAMS[name] if other else {}
    got = build_loss(name, **hparams)(x, labels)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(reference(name, x, labels, **hparams), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_without_normalisation(name: str) -> None:
    x, labels = balanced_batch(4, 3, 4, 5, scale=0.4)
    got = build_loss(name, normalize=False)(x, labels)
    assert got.item() == pytest.approx(reference(name, x, labels, normalize=False), rel=1e-6, abs=1e-6)


def test_references_are_not_trivially_zero() -> None:
    """The reference batches exercise active hinges/mined pairs, so the comparisons above mean something."""
    x, labels = BATCHES["4x3"]()
    for name in NAMES:
        assert reference(name, x, labels) > 1e-3, name


# ---------------------------------------------------------------------------------------------------
# 2. gradcheck
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("other", [False, True], ids=["defaults", "other-hparams"])
@pytest.mark.parametrize("name", NAMES)
def test_gradcheck(name: str, other: bool) -> None:
    x, labels = balanced_batch(5, 3, 4, 5)
    loss = build_loss(name, **(OTHER_HPARAMS[name] if other else {}))
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (x,), eps=1e-6, atol=1e-5)


def test_masked_logsumexp_is_stable_and_empty_rows_are_zero() -> None:
    x = torch.tensor([[1000.0, -1000.0, 3.0], [0.5, 0.25, -2.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, True], [False, False, False]])
    x.requires_grad_()
    plain = masked_logsumexp(x, mask)
    with_one = masked_logsumexp(x, mask, add_one=True)
    expected_row1 = math.log(math.exp(0.5) + math.exp(-2.0))
    assert plain.tolist() == pytest.approx([1000.0, expected_row1, 0.0])
    assert with_one.tolist() == pytest.approx([1000.0, math.log1p(math.exp(0.5) + math.exp(-2.0)), 0.0])
    (grad,) = torch.autograd.grad((plain + with_one).sum(), x)
    assert torch.isfinite(grad).all()
    assert grad[2].abs().sum() == 0 and grad[0, 2] == 0  # empty row and masked entries get no gradient
    assert torch.autograd.gradcheck(
        lambda t: masked_logsumexp(t, mask, add_one=True) + masked_logsumexp(t, mask),
        (torch.randn(3, 3, dtype=torch.float64, requires_grad=True),),
    )


def test_head_normalisation_then_loss_normalisation_keeps_the_gradient() -> None:
    """Normalising inside the loss is a no-op for the trainer, whose head already normalises."""
    z, labels = balanced_batch(6, 3, 4, 5, scale=2.0)
    for name in NAMES:
        grads = []
        for inner in (True, False):
            loss = build_loss(name, normalize=inner)(F.normalize(z, dim=1), labels)
            grads.append(torch.autograd.grad(loss, z)[0])
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------------------------------
# 3. pytorch-metric-learning parity (value and gradient, float64)
# ---------------------------------------------------------------------------------------------------


def assert_same_value_and_grad(ours: torch.Tensor, theirs: torch.Tensor, x: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    (g_ours,) = torch.autograd.grad(ours, x, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(theirs, x, retain_graph=True)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-9, atol=1e-12)


PML_BATCHES = {
    "8x4": lambda: balanced_batch(10, 8, 4, 16),
    "6x2-shuffled": lambda: balanced_batch(11, 6, 2, 8, shuffle=True),
    "unbalanced": BATCHES["unbalanced"],
}


@pytest.mark.parametrize("batch", list(PML_BATCHES))
@pytest.mark.parametrize("margins", [(1.0, 0.0), (0.4, 0.2)], ids=["defaults", "other"])
def test_lifted_equals_pml(margins: tuple[float, float], batch: str) -> None:
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    neg_margin, pos_margin = margins
    x, labels = PML_BATCHES[batch]()
    ours = build_loss("lifted", neg_margin=neg_margin, pos_margin=pos_margin)(x, labels)
    theirs = pml.LiftedStructureLoss(neg_margin=neg_margin, pos_margin=pos_margin)(x, labels)
    assert_same_value_and_grad(ours, theirs, x)


@pytest.mark.parametrize("batch", list(PML_BATCHES))
@pytest.mark.parametrize("margin", [0.2, 1.0])
def test_hphn_equals_pml_batch_hard(margin: float, batch: str) -> None:
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import TripletMarginLoss
    from pytorch_metric_learning.miners import BatchHardMiner
    from pytorch_metric_learning.reducers import MeanReducer

    x, labels = PML_BATCHES[batch]()
    ours = build_loss("hphn-triplet", margin=margin)(x, labels)
    theirs = TripletMarginLoss(margin=margin, reducer=MeanReducer())(x, labels, BatchHardMiner()(x, labels))
    assert_same_value_and_grad(ours, theirs, x)


@pytest.mark.parametrize("batch", list(PML_BATCHES))
def test_triplet_equals_pml_with_mean_reducer_and_differs_from_its_default(batch: str) -> None:
    """Ours is pml's TripletMarginLoss (no miner) with MeanReducer: mean over *all* valid triplets.

    pml's default AvgNonZeroReducer averages only the violating triplets, i.e. ours times
    (#triplets / #non-zero triplets).
    """
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import TripletMarginLoss
    from pytorch_metric_learning.reducers import DoNothingReducer, MeanReducer

    x, labels = PML_BATCHES[batch]()
    ours = build_loss("triplet", margin=0.1)(x, labels)
    assert_same_value_and_grad(ours, TripletMarginLoss(margin=0.1, reducer=MeanReducer())(x, labels), x)

    per_triplet = TripletMarginLoss(margin=0.1, reducer=DoNothingReducer())(x, labels)["loss"]["losses"]
    n_triplets, n_nonzero = len(per_triplet), int((per_triplet > 0).sum())
    assert 0 < n_nonzero < n_triplets
    pml_default = TripletMarginLoss(margin=0.1)(x, labels)
    torch.testing.assert_close(pml_default, ours * n_triplets / n_nonzero)


@pytest.mark.parametrize("batch", list(PML_BATCHES))
@pytest.mark.parametrize("other", [False, True], ids=["defaults", "other-hparams"])
def test_ms_equals_pml_loss_with_pml_miner(other: bool, batch: str) -> None:
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import MultiSimilarityLoss
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    hp = {**LOSSES["ms"].defaults, **(OTHER_HPARAMS["ms"] if other else {})}
    x, labels = PML_BATCHES[batch]()
    ours = build_loss("ms", **hp)(x, labels)
    pairs = MultiSimilarityMiner(epsilon=hp["epsilon"])(x, labels)
    theirs = MultiSimilarityLoss(alpha=hp["alpha"], beta=hp["beta"], base=hp["base"])(x, labels, pairs)
    assert_same_value_and_grad(ours, theirs, x)


def test_ms_single_mined_pair_corner_differs_from_pml() -> None:
    """When mining keeps one positive and one negative pair in the whole batch, pml's GenericPairLoss
    returns 0 ("<= 1 pair per kind"); ours evaluates the MS equation."""
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import MultiSimilarityLoss
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    # S_01 = S_02 = 0.5 (anchor 0 keeps both its pairs), S_12 = 0 (anchor 1 keeps neither), 2 has no positive
    x = torch.tensor(
        [[1.0, 0.0, 0.0], [0.5, math.sqrt(3) / 2, 0.0], [0.5, -0.5 / math.sqrt(3), math.sqrt(2 / 3)]],
        dtype=torch.float64,
    )
    labels = torch.tensor([0, 0, 1])
    mined = MultiSimilarityMiner(epsilon=0.1)(x, labels)
    assert [len(t) for t in mined] == [1, 1, 1, 1]
    assert MultiSimilarityLoss()(x, labels, mined).item() == 0.0
    expected = (math.log(2) / 2 + math.log(2) / 50) / 3
    assert build_loss("ms")(x, labels).item() == pytest.approx(expected, rel=1e-9)
    assert reference("ms", x, labels) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("batch", list(PML_BATCHES))
def test_contrastive_relationship_to_pml(batch: str) -> None:
    """pml's ContrastiveLoss uses the plain hinge per pair, [D - m_pos]_+ and [m_neg - D]_+.

    Exactly: ours with power=1 == pml with MeanReducer (value and gradient). Our default power=2 is
    Hadsell's (1/2) hinge^2 on the same per-pair hinges, averaged over positive and negative pairs
    separately. pml's default AvgNonZeroReducer averages only the non-zero hinges of each kind.
    """
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import ContrastiveLoss as PmlContrastive
    from pytorch_metric_learning.reducers import DoNothingReducer, MeanReducer

    x, labels = PML_BATCHES[batch]()
    margins = {"pos_margin": 0.1, "neg_margin": 1.0}
    ours_hinge = build_loss("contrastive", power=1.0, **margins)(x, labels)
    assert_same_value_and_grad(ours_hinge, PmlContrastive(**margins, reducer=MeanReducer())(x, labels), x)

    per_pair = PmlContrastive(**margins, reducer=DoNothingReducer())(x, labels)
    pos, neg = per_pair["pos_loss"]["losses"], per_pair["neg_loss"]["losses"]
    hadsell = build_loss("contrastive", **margins)(x, labels)
    torch.testing.assert_close(hadsell, pos.pow(2).mean() / 2 + neg.pow(2).mean() / 2)
    pml_default = PmlContrastive(**margins)(x, labels)
    torch.testing.assert_close(pml_default, pos[pos > 0].mean() + neg[neg > 0].mean())
    assert not torch.isclose(pml_default, ours_hinge)


# ---------------------------------------------------------------------------------------------------
# 4. Degenerate batches: defined zeros, never NaN
# ---------------------------------------------------------------------------------------------------

_GEN = torch.Generator().manual_seed(20)
ZERO_BATCHES = {  # no positive or no negative pair: 0 (contrastive keeps whichever of its two terms exists)
    "single-sample": (torch.randn(1, 4, generator=_GEN, dtype=torch.float64), torch.tensor([3])),
    "single-class": (torch.randn(5, 4, generator=_GEN, dtype=torch.float64), torch.tensor([2, 2, 2, 2, 2])),
    # close together, so the contrastive push term (neg_margin 1) is active
    "no-positive-pair": (
        1 + 0.2 * torch.randn(4, 4, generator=_GEN, dtype=torch.float64),
        torch.tensor([0, 1, 2, 3]),
    ),
}


@pytest.mark.parametrize("batch", list(ZERO_BATCHES))
@pytest.mark.parametrize("name", NAMES)
def test_degenerate_batches_give_connected_zero(name: str, batch: str) -> None:
    x, labels = ZERO_BATCHES[batch]
    x = x.clone().requires_grad_()
    loss = build_loss(name)(x, labels)
    if name == "contrastive" and batch != "single-sample":
        # pull and push are separate means: the one whose pairs exist still applies
        assert loss.item() == pytest.approx(reference(name, x, labels)) and loss.item() > 0
    else:
        assert loss.item() == 0.0
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", ["identical", "antipodal", "zero-vector", "huge"])
def test_extreme_embeddings_are_finite(name: str, case: str) -> None:
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    base = torch.randn(6, 4, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    if case == "identical":
        x = base[:1].repeat(6, 1)
    elif case == "antipodal":
        v = base[0]
        x = torch.stack([v, v, -v, -v, v, -v])
    elif case == "zero-vector":
        x = base.clone()
        x[1] = 0
    else:
        x = base * 1e6
    for dtype in (torch.float64, torch.float32):
        xd = x.to(dtype).detach().clone().requires_grad_()
        loss = build_loss(name)(xd, labels)
        loss.backward()
        assert torch.isfinite(loss), (name, case, dtype)
        assert torch.isfinite(xd.grad).all(), (name, case, dtype)


def test_float32_matches_float64_at_training_size() -> None:
    """B=128, d=512 (the trainer's shape): float32 agrees with float64, incl. MS's beta=50 exponent."""
    gen = torch.Generator().manual_seed(7)
    labels = torch.arange(32).repeat_interleave(4)
    x64 = torch.randn(32, 512, generator=gen, dtype=torch.float64)[labels] + torch.randn(
        128, 512, generator=gen, dtype=torch.float64
    )
    for name in NAMES:
        v64 = build_loss(name)(x64, labels)
        v32 = build_loss(name)(x64.float(), labels)
        assert v32.item() == pytest.approx(v64.item(), rel=1e-4, abs=1e-6), name


# ---------------------------------------------------------------------------------------------------
# 5. Registry and argument checks
# ---------------------------------------------------------------------------------------------------


def test_registered_with_paper_defaults_and_layout() -> None:
    expected = {
        "contrastive": {"pos_margin": 0.0, "neg_margin": 1.0, "power": 2.0, "normalize": True},
        "triplet": {"margin": 0.1, "normalize": True},
        "hphn-triplet": {"margin": 0.2, "normalize": True},
        "lifted": {"neg_margin": 1.0, "pos_margin": 0.0, "normalize": True},
        "ms": {"alpha": 2.0, "beta": 50.0, "base": 0.5, "epsilon": 0.1, "normalize": True},
    }
    for name, defaults in expected.items():
        spec = LOSSES[name]
        assert spec.defaults == defaults
        assert (spec.layout.kind, spec.layout.classes, spec.layout.samples_per_class) == (
            "classes_x_samples",
            32,
            4,
        )
        assert isinstance(build_loss(name), torch.nn.Module)
    with pytest.raises(ValueError, match="no hyperparameter"):
        build_loss("lifted", margin=0.3)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="power"):
        ContrastiveLoss(power=0.5)
    with pytest.raises(ValueError, match="labels"):
        build_loss("ms")(torch.randn(4, 3), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="embeddings"):
        build_loss("triplet")(torch.randn(4), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="B >= 1"):
        build_loss("lifted")(torch.randn(0, 3), torch.tensor([], dtype=torch.long))


def test_extra_batch_info_is_accepted() -> None:
    x, labels = balanced_batch(8, 3, 2, 4)
    assert torch.isfinite(build_loss("hphn-triplet")(x, labels, cluster_ids=labels))
