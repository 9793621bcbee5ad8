"""LoOp losses (Vasudeva et al., ICCV 2021, Sec. 3.3): triplet, HPHN-triplet, lifted structure, MS."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.training.losses.reference_loop import (
    hardest_negative_reference,
    multi_similarity_reference,
    triplet_reference,
)
from training.losses import LOSSES, build_loss
from training.losses.baselines import MultiSimilarityLoss, batch_hard_triplet_loss, triplet_loss
from training.losses.loop import (
    LoOpHPHNTripletLoss,
    LoOpLiftedStructureLoss,
    LoOpMultiSimilarityLoss,
    LoOpTripletLoss,
    loop_distance_matrix,
)
from training.losses.pairs import label_masks, pairwise_distances

CLASSES = {
    "loop-triplet": LoOpTripletLoss,
    "loop-hphn-triplet": LoOpHPHNTripletLoss,
    "loop-lifted": LoOpLiftedStructureLoss,
    "loop-ms": LoOpMultiSimilarityLoss,
}
NAMES = sorted(CLASSES)
FORMS = ["loop", "endpoints"]
# Consecutive same-class pairs; classes of 2 and 4, a class's pairs not necessarily adjacent, odd ids.
LAYOUTS = {
    "2 per class": [5, 5, 1, 1, 8, 8, 3, 3, 0, 0],
    "4 per class": [2, 2, 2, 2, 7, 7, 7, 7, 4, 4, 4, 4],
    "mixed": [3, 3, 9, 9, 3, 3, 6, 6, 9, 9, 1, 1],
}
# Hyperparameters that keep every term active enough to test (the defaults are tested separately).
ACTIVE = {
    "loop-triplet": {"margin": 0.5},
    "loop-hphn-triplet": {"margin": 0.5},
    "loop-lifted": {"margin": 0.5},
    "loop-ms": {"alpha": 2.0, "beta": 10.0, "base": 0.3, "epsilon": 0.3},
}


def _batch(
    seed: int, labels: list[int], dim: int = 5, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings scattered around per-class centres (so LoOp's optimum falls in varied KKT cases)."""
    gen = torch.Generator().manual_seed(seed)
    label_tensor = torch.tensor(labels)
    centres = torch.randn(max(labels) + 1, dim, generator=gen, dtype=torch.float64)
    x = centres[label_tensor] + 0.8 * torch.randn(len(labels), dim, generator=gen, dtype=torch.float64)
    return x.to(dtype), label_tensor


def _reference(
    name: str, x: torch.Tensor, labels: torch.Tensor, form: str, normalize: bool, **hp: float
) -> float:
    rows, ids = x.tolist(), labels.tolist()
    if name == "loop-triplet":
        return triplet_reference(rows, ids, hp["margin"], form, normalize)
    if name == "loop-ms":
        return multi_similarity_reference(
            rows, ids, hp["alpha"], hp["beta"], hp["base"], hp["epsilon"], form, normalize
        )
    return hardest_negative_reference(rows, ids, hp["margin"], form, name == "loop-hphn-triplet", normalize)


def _loss(name: str, form: str, normalize: bool = True, **hp: Any) -> torch.nn.Module:
    return CLASSES[name](**{**LOSSES[name].defaults, **hp, "hard_negatives": form, "normalize": normalize})


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------


def test_registered_with_paper_defaults_and_pair_layout() -> None:
    expected = {
        "loop-triplet": ({"margin": 0.1, "normalize": True}, 2),
        "loop-hphn-triplet": ({"margin": 0.2, "normalize": True}, 8),
        "loop-lifted": ({"margin": 0.2, "normalize": True}, 2),
        "loop-ms": ({"alpha": 2.0, "beta": 50.0, "base": 0.5, "epsilon": 0.1, "normalize": True}, 4),
    }
    for name, (defaults, per_class) in expected.items():
        spec = LOSSES[name]
        assert spec.defaults == defaults
        assert spec.fixed == {"hard_negatives": "loop"}
        assert spec.layout.kind == "classes_x_samples"
        assert spec.layout.samples_per_class == per_class and spec.layout.batch_size == 32  # Sec. 4: B = 32
        assert spec.layout.description == "even number per class"
        assert "LoOp" in spec.paper
        loss = build_loss(name)
        assert isinstance(loss, CLASSES[name]) and loss.hard_negatives == "loop"
        with pytest.raises(ValueError, match="hard_negatives"):
            build_loss(name, hard_negatives="endpoints")  # fixed: the base form is the class itself


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="hard_negatives"):
        LoOpTripletLoss(hard_negatives="hardest")  # type: ignore[arg-type]
    x, labels = _batch(0, LAYOUTS["2 per class"])
    with pytest.raises(ValueError, match="embeddings"):
        LoOpTripletLoss()(x[:, 0], labels)
    with pytest.raises(ValueError, match="even"):
        LoOpTripletLoss()(x[:3], labels[:3])
    with pytest.raises(ValueError, match="even"):
        LoOpTripletLoss()(x[:1], labels[:1])
    with pytest.raises(ValueError, match="consecutive"):
        LoOpTripletLoss()(x, labels.roll(1))


# ---------------------------------------------------------------------------------------------------
# (f): the vectorised losses equal the plain-loop references
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name: str, form: str, layout: str) -> None:
    for seed in range(3):
        x, labels = _batch(seed, LAYOUTS[layout])
        for hp in (LOSSES[name].defaults, ACTIVE[name]):
            hp = {k: v for k, v in hp.items() if k != "normalize"}
            ours = _loss(name, form, **hp)(x, labels).item()
            assert ours == pytest.approx(_reference(name, x, labels, form, True, **hp), abs=1e-6, rel=1e-6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_without_normalisation(name: str, form: str) -> None:
    """Sec. 4.2: raw embeddings, straight segments between the pair members."""
    for seed in range(2):
        x, labels = _batch(seed, LAYOUTS["mixed"])
        x = 0.5 * x  # keep the MS similarities 1 - d^2/2 in a sensible range
        ours = _loss(name, form, normalize=False, **ACTIVE[name])(x, labels).item()
        assert ours == pytest.approx(
            _reference(name, x, labels, form, False, **ACTIVE[name]), abs=1e-6, rel=1e-6
        )


def test_references_are_not_trivially_zero() -> None:
    x, labels = _batch(0, LAYOUTS["mixed"])
    for name in NAMES:
        for form in FORMS:
            assert _loss(name, form, **ACTIVE[name])(x, labels).item() > 0.01


# ---------------------------------------------------------------------------------------------------
# (d): a LoOp loss is never below its base form (its negatives are never farther)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_loop_is_never_below_its_base_form(name: str, dtype: torch.dtype) -> None:
    slack = 1e-5 if dtype == torch.float32 else 1e-12
    differs = False
    for seed in range(20):
        x, labels = _batch(seed, LAYOUTS["mixed" if seed % 2 else "2 per class"], dtype=dtype)
        for hp in (LOSSES[name].defaults, ACTIVE[name]):
            hp = {k: v for k, v in hp.items() if k != "normalize"}
            loop, base = (_loss(name, form, **hp)(x, labels).item() for form in FORMS)
            assert loop >= base - slack
            differs |= loop > base + 1e-6
    assert differs


@pytest.mark.parametrize("normalize", [True, False])
def test_loop_negatives_are_never_farther_than_the_endpoints(normalize: bool) -> None:
    x, labels = _batch(1, LAYOUTS["mixed"])
    x = torch.nn.functional.normalize(x, dim=1) if normalize else x
    dist = pairwise_distances(x)
    _, neg_mask = label_masks(labels)
    loop = loop_distance_matrix(dist, neg_mask, "loop", "arc" if normalize else "segment")
    assert (loop <= dist + 1e-12).all()
    assert torch.equal(loop[~neg_mask], dist[~neg_mask])  # positives are untouched
    assert (loop[neg_mask] < dist[neg_mask] - 1e-6).any()
    assert loop_distance_matrix(dist, neg_mask, "endpoints", "arc") is dist


# ---------------------------------------------------------------------------------------------------
# (e): gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", NAMES)
def test_gradcheck(name: str, form: str, normalize: bool) -> None:
    x, labels = _batch(2, [3, 3, 9, 9, 3, 3, 6, 6], dim=4)  # two classes of 2, one of 4
    x = 0.5 * x if not normalize else x
    loss = _loss(name, form, normalize=normalize, **ACTIVE[name])
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (x.requires_grad_(True),))


# ---------------------------------------------------------------------------------------------------
# Degenerate batches
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", NAMES)
def test_single_class_gives_a_connected_zero(name: str, form: str) -> None:
    x, _ = _batch(0, [0] * 6)
    x.requires_grad_(True)
    value = _loss(name, form)(x, torch.zeros(6, dtype=torch.long))
    value.backward()
    assert value.item() == 0.0
    assert torch.equal(x.grad, torch.zeros_like(x))


EXTREME = {
    "identical pair members": lambda x: x.index_copy(0, torch.tensor([1]), x[:1]),
    "identical across classes": lambda x: x.index_copy(0, torch.tensor([2, 3]), x[:2]),
    "all identical": lambda x: x[:1].expand_as(x).clone(),
    "antipodal pair members": lambda x: x.index_copy(0, torch.tensor([1]), -x[:1]),
    "antipodal across classes": lambda x: x.index_copy(0, torch.tensor([2, 3]), -x[:2]),
    "collinear": lambda x: x[:, :1] * torch.linspace(-1, 1, len(x), dtype=x.dtype).unsqueeze(1) + x[:1, 1:2],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", sorted(EXTREME))
@pytest.mark.parametrize("name", NAMES)
def test_extreme_embeddings_are_finite(name: str, case: str, dtype: torch.dtype) -> None:
    x, labels = _batch(3, LAYOUTS["mixed"], dtype=dtype)
    x = EXTREME[case](x).detach()
    for form in FORMS:
        for normalize in (True, False):
            e = x.clone().requires_grad_(True)
            value = _loss(name, form, normalize=normalize)(e, labels)
            value.backward()
            assert torch.isfinite(value) and torch.isfinite(e.grad).all(), (form, normalize)


@pytest.mark.parametrize("name", NAMES)
def test_float32_matches_float64_at_training_size(name: str) -> None:
    gen = torch.Generator().manual_seed(9)
    labels = torch.arange(32).repeat_interleave(4)
    x = (
        torch.randn(128, 512, generator=gen, dtype=torch.float64)
        + 2 * torch.randn(32, 512, generator=gen, dtype=torch.float64)[labels]
    )
    for form in FORMS:
        loss = _loss(name, form, **ACTIVE[name])
        torch.testing.assert_close(loss(x.float(), labels).double(), loss(x, labels), rtol=1e-4, atol=1e-5)


def test_extra_batch_info_is_accepted() -> None:
    x, labels = _batch(0, LAYOUTS["2 per class"])
    for name in NAMES:
        assert torch.isfinite(build_loss(name)(x, labels, cluster_ids=None, epoch=3))


# ---------------------------------------------------------------------------------------------------
# Relations to pytorch-metric-learning and to the baselines
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["4 per class", "mixed"])
def test_base_ms_equals_pml_ms_with_ms_miner(layout: str) -> None:
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import MultiSimilarityLoss as PmlMS
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    x, labels = _batch(4, LAYOUTS[layout])
    hp = {"alpha": 2.0, "beta": 10.0, "base": 0.5}
    ours_x, pml_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = LoOpMultiSimilarityLoss(**hp, epsilon=0.1, hard_negatives="endpoints")(ours_x, labels)
    theirs = PmlMS(**hp)(pml_x, labels, MultiSimilarityMiner(epsilon=0.1)(pml_x, labels))
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_x.grad, pml_x.grad)
    # the same building blocks as the ms baseline (which uses dot products instead of 1 - d^2/2)
    torch.testing.assert_close(ours, MultiSimilarityLoss(**hp, epsilon=0.1)(x, labels))


def test_base_triplet_equals_pml_triplet_on_the_pair_triplets() -> None:
    """Eq. 14 is pml's TripletMarginLoss summed over the triplets (i, partner(i), k) and divided by
    |P| = B; pml's default (AvgNonZeroReducer over all valid triplets) is a different normalisation
    and a larger triplet set when classes have more than two samples."""
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning.losses import TripletMarginLoss
    from pytorch_metric_learning.reducers import SumReducer

    x, labels = _batch(5, LAYOUTS["mixed"])
    anchors, negatives = torch.nonzero(labels.unsqueeze(1) != labels.unsqueeze(0), as_tuple=True)
    triplets = (anchors, anchors ^ 1, negatives)
    theirs = TripletMarginLoss(margin=0.5, reducer=SumReducer())(x, labels, triplets) / len(x)
    ours = LoOpTripletLoss(margin=0.5, hard_negatives="endpoints")(x, labels)
    torch.testing.assert_close(ours, theirs)
    assert not torch.isclose(ours, TripletMarginLoss(margin=0.5)(x, labels))


def test_base_triplet_is_the_triplet_baseline_times_negatives_per_anchor() -> None:
    """With two samples per class the triplets coincide; Eq. 14 sums over the negatives where the
    ``triplet`` baseline averages, a factor B - 2."""
    x, labels = _batch(6, LAYOUTS["2 per class"])
    xn = torch.nn.functional.normalize(x, dim=1)
    pos_mask, neg_mask = label_masks(labels)
    baseline = triplet_loss(pairwise_distances(xn), pos_mask, neg_mask, 0.5)
    ours = LoOpTripletLoss(margin=0.5, hard_negatives="endpoints")(x, labels)
    torch.testing.assert_close(ours, baseline * (len(x) - 2))


@pytest.mark.parametrize("form", FORMS)
def test_hphn_equals_lifted_with_two_samples_per_class(form: str) -> None:
    """Sec. 3.3.3: with two samples per class HPHN-triplet and LS coincide."""
    x, labels = _batch(7, LAYOUTS["2 per class"])
    hphn = LoOpHPHNTripletLoss(margin=0.5, hard_negatives=form)(x, labels)
    lifted = LoOpLiftedStructureLoss(margin=0.5, hard_negatives=form)(x, labels)
    torch.testing.assert_close(hphn, lifted)
    x4, labels4 = _batch(7, LAYOUTS["4 per class"])
    hphn4 = LoOpHPHNTripletLoss(margin=0.5, hard_negatives=form)(x4, labels4)
    assert hphn4 > LoOpLiftedStructureLoss(margin=0.5, hard_negatives=form)(x4, labels4)


def test_base_hphn_is_per_pair_not_per_anchor() -> None:
    """LoOp writes HPHN per pair, with the min over both members' negatives; the hphn-triplet baseline
    (Hermans et al., pml's BatchHardMiner) has one term per anchor. Per pair the hinge is the larger of
    its two members' per-anchor hinges, so ours is >= the baseline (and differs)."""
    x, labels = _batch(8, LAYOUTS["2 per class"])
    xn = torch.nn.functional.normalize(x, dim=1)
    pos_mask, neg_mask = label_masks(labels)
    per_anchor = batch_hard_triplet_loss(pairwise_distances(xn), pos_mask, neg_mask, 0.5)
    ours = LoOpHPHNTripletLoss(margin=0.5, hard_negatives="endpoints")(x, labels)
    assert ours > per_anchor + 1e-3
    dist = pairwise_distances(xn)
    hardest_neg = dist.masked_fill(~neg_mask, float("inf")).amin(1)
    hinge = (dist[torch.arange(len(x)), torch.arange(len(x)) ^ 1] + 0.5 - hardest_neg).relu()
    torch.testing.assert_close(ours, hinge.view(-1, 2).amax(1).mean())
