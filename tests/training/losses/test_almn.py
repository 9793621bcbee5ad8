"""ALMN (Chen & Deng, ECCV 2018): Eq. 8 with Virtual Point Generating (Eq. 6-7) and the centre update Eq. 2.

pytorch-metric-learning has no ALMN; the checks are against the plain-loop references in reference_almn.py
and hand-worked centre updates.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tests.training.losses.reference_almn import almn_angles, almn_reference, centre_update_reference
from training.losses import LOSSES, build_loss
from training.losses.almn import ALMNLoss


def _batch(seed: int, classes: int, per_class: int, dim: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples scattered around per-class directions, in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(classes, dim, generator=generator, dtype=torch.float64)
    labels = torch.arange(classes).repeat_interleave(per_class)
    embeddings = directions[labels] + 0.8 * torch.randn(
        len(labels), dim, generator=generator, dtype=torch.float64
    )
    order = torch.randperm(len(labels), generator=generator)
    return embeddings[order], labels[order]


def _with_centres(centres: torch.Tensor, **hparams: float) -> ALMNLoss:
    """An ALMN loss whose centre buffer is loaded from a state dict (every class seen)."""
    loss = ALMNLoss(**hparams)
    loss.load_state_dict({"centres": centres, "seen": torch.ones(len(centres), dtype=torch.bool)})
    return loss


def _random_centres(seed: int, classes: int, dim: int = 5) -> torch.Tensor:
    return torch.randn(classes, dim, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)


def _centre_dict(centres: torch.Tensor) -> dict[int, list[float]]:
    return dict(enumerate(centres.tolist()))


def test_registry_entry() -> None:
    spec = LOSSES["almn"]
    assert spec.defaults == {"beta": 3.0, "l2_reg": 0.0005, "center_lr": 0.5}
    assert spec.layout.kind == "classes_x_samples"
    assert (spec.layout.classes, spec.layout.samples_per_class) == (26, 5)
    assert spec.layout.description == "26 classes x 5"
    loss = build_loss("almn", beta=0.0)
    assert isinstance(loss, ALMNLoss) and loss.beta == 0.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [0.0, 1.0, 3.0])
def test_matches_reference(seed: int, beta: float) -> None:
    embeddings, labels = _batch(seed, classes=4, per_class=3)
    centres = _random_centres(seed, 4)
    loss = _with_centres(centres, beta=beta, l2_reg=0.01).eval()
    expected = almn_reference(embeddings.tolist(), labels.tolist(), _centre_dict(centres), beta, 0.01)
    assert loss(embeddings, labels).item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_reference_batches_have_easy_and_hard_patterns() -> None:
    """The batches above exercise both branches: theta_nn > theta_i (margin), theta_nn <= theta_i (none)."""
    easy = hard = 0
    for seed in range(4):
        embeddings, labels = _batch(seed, classes=4, per_class=3)
        for theta_nn, theta_i in almn_angles(
            embeddings.tolist(), labels.tolist(), _centre_dict(_random_centres(seed, 4))
        ):
            easy, hard = easy + (theta_nn > theta_i), hard + (theta_nn <= theta_i)
    assert easy >= 5 and hard >= 5


def test_beta_zero_is_eq3_baseline() -> None:
    """beta = 0 gives x_g = x_i: Eq. 3, written out here without any virtual point."""
    embeddings, labels = _batch(7, classes=3, per_class=4)
    centres = _random_centres(7, 3)
    loss = _with_centres(centres, beta=0.0, l2_reg=0.02).eval()(embeddings, labels)
    total = 0.0
    for i in range(len(labels)):
        c = centres[labels[i]]
        positive = torch.exp(embeddings[i] @ c)
        negatives = sum(torch.exp(embeddings[j] @ c) for j in range(len(labels)) if labels[j] != labels[i])
        total += -torch.log(positive / (positive + negatives)).item()
    expected = total / len(labels) + 0.02 / (2 * len(labels)) * embeddings.pow(2).sum().item()
    assert loss.item() == pytest.approx(expected, rel=1e-9)


def test_centre_update_eq2_by_hand() -> None:
    # d = 2, alpha = 0.5; centres c0 = (0, 0), c1 = (1, 1), c2 = (4, 4); batch: class 0 {(1, 0), (0, 1)},
    # class 1 {(3, 1)}; class 2 absent.
    #   c0 <- (0,0) - 0.5 * [((0,0)-(1,0)) + ((0,0)-(0,1))] / (1 + 2) = (0,0) - 0.5 * (-1,-1)/3 = (1/6, 1/6)
    #   c1 <- (1,1) - 0.5 * ((1,1)-(3,1)) / (1 + 1) = (1,1) - 0.5 * (-2,0)/2 = (1.5, 1)
    #   c2 unchanged (4, 4)
    centres = torch.tensor([[0.0, 0.0], [1.0, 1.0], [4.0, 4.0]], dtype=torch.float64)
    loss = _with_centres(centres, center_lr=0.5).train()
    embeddings = torch.tensor([[1.0, 0.0], [3.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0])
    loss(embeddings, labels)
    expected = torch.tensor([[1 / 6, 1 / 6], [1.5, 1.0], [4.0, 4.0]], dtype=torch.float64)
    torch.testing.assert_close(loss.centres, expected)
    reference = centre_update_reference(_centre_dict(centres), embeddings.tolist(), labels.tolist(), 0.5)
    torch.testing.assert_close(
        loss.centres, torch.tensor([reference[z] for z in range(3)], dtype=torch.float64)
    )


@pytest.mark.parametrize("seed", range(3))
def test_centre_update_matches_reference(seed: int) -> None:
    embeddings, labels = _batch(seed, classes=5, per_class=3)
    keep = labels != 4  # class 4 absent from the batch keeps its centre
    centres = _random_centres(seed, 5)
    loss = _with_centres(centres, center_lr=0.3).train()
    loss(embeddings[keep], labels[keep])
    reference = centre_update_reference(
        _centre_dict(centres), embeddings[keep].tolist(), labels[keep].tolist(), 0.3
    )
    torch.testing.assert_close(
        loss.centres, torch.tensor([reference[z] for z in range(5)], dtype=torch.float64)
    )


def test_first_sight_initialises_to_batch_mean() -> None:
    embeddings, labels = _batch(2, classes=3, per_class=4)
    labels = labels * 2 + 1  # sparse ids 1, 3, 5: the buffer grows to 6 rows
    loss = ALMNLoss(beta=3.0, l2_reg=0.0005).train()
    value = loss(embeddings, labels)
    means = {z: embeddings[labels == z].mean(0) for z in (1, 3, 5)}
    assert loss.centres.shape == (6, 5)
    assert loss.seen.tolist() == [False, True, False, True, False, True]
    for z, mean in means.items():
        torch.testing.assert_close(loss.centres[z], mean)  # Eq. 2 leaves a batch-mean centre unchanged
    expected = almn_reference(
        embeddings.tolist(), labels.tolist(), {z: m.tolist() for z, m in means.items()}, 3.0, 0.0005
    )
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_buffer_grows_and_keeps_old_centres() -> None:
    loss = ALMNLoss().train()
    embeddings, labels = _batch(0, classes=3, per_class=2)
    loss(embeddings, labels)
    before = loss.centres.clone()
    more, more_labels = _batch(1, classes=2, per_class=2)
    loss(more, more_labels + 10)  # classes 10, 11
    assert loss.centres.shape == (12, 5)
    torch.testing.assert_close(loss.centres[:3], before)
    assert loss.seen.tolist() == [True] * 3 + [False] * 7 + [True] * 2


def test_eval_mode_leaves_buffers_alone() -> None:
    loss = ALMNLoss().eval()
    embeddings, labels = _batch(0, classes=3, per_class=2)
    loss(embeddings, labels)
    assert loss.centres.shape == (0, 0) and loss.seen.shape == (0,)
    trained = ALMNLoss().train()
    trained(embeddings, labels)
    state = copy.deepcopy(trained.state_dict())
    trained.eval()(embeddings + 1.0, labels)
    torch.testing.assert_close(trained.state_dict(), state)


def test_state_dict_round_trip_keeps_centres() -> None:
    loss = ALMNLoss(beta=2.0).train()
    for seed in range(3):
        embeddings, labels = _batch(seed, classes=4, per_class=3)
        loss(embeddings, labels + seed)  # classes 0..6 over the three batches
    buffer = io.BytesIO()
    torch.save(loss.state_dict(), buffer)
    buffer.seek(0)
    restored = ALMNLoss(beta=2.0)
    restored.load_state_dict(torch.load(buffer))
    assert set(loss.state_dict()) == {"centres", "seen"}
    torch.testing.assert_close(restored.centres, loss.centres)
    assert torch.equal(restored.seen, loss.seen)
    embeddings, labels = _batch(9, classes=4, per_class=3)
    torch.testing.assert_close(restored.eval()(embeddings, labels), loss.eval()(embeddings, labels))
    # Buffers follow module conversions (device/dtype moves use the same mechanism).
    assert restored.float().centres.dtype == torch.float32


@pytest.mark.parametrize("beta", [0.0, 3.0])
def test_gradcheck(beta: float) -> None:
    """Centres are constants of the loss; the update is a side effect. Each call runs in training mode on
    a fresh copy of the same trained module, so the function is deterministic and the full training
    path (update included) is checked, unchanged."""
    embeddings, labels = _batch(5, classes=3, per_class=3, dim=4)
    trained = _with_centres(_random_centres(5, 3, dim=4), beta=beta, l2_reg=0.01).train()
    calls = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        module = copy.deepcopy(trained)
        value = module(x, labels)
        calls.append(not torch.equal(module.centres, trained.centres))
        return value

    assert torch.autograd.gradcheck(loss, (embeddings.requires_grad_(),), eps=1e-6, atol=1e-5)
    assert all(calls)  # the side effect did happen, on the copies
    torch.testing.assert_close(loss(embeddings), trained.eval()(embeddings, labels))


def _finite_with_grad(loss: torch.nn.Module, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    embeddings = embeddings.clone().requires_grad_()
    value = loss(embeddings, labels)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(embeddings.grad).all()
    return value.detach()


def test_degenerate_batches() -> None:
    x, _ = _batch(4, classes=6, per_class=1)
    # Single class / a single sample: no negatives, data term 0, the loss is the L2 term alone.
    for labels in ([0, 0, 0, 0, 0, 0], [2]):
        batch = x[: len(labels)]
        value = _finite_with_grad(ALMNLoss(l2_reg=0.5).train(), batch, torch.tensor(labels))
        assert value.item() == pytest.approx(0.25 * batch.pow(2).sum(1).mean().item())
        assert _finite_with_grad(ALMNLoss(l2_reg=0.0).train(), batch, torch.tensor(labels)).item() == 0.0
    # Every class a singleton seen for the first time: x_i = c exactly, so x_g = x_i.
    labels = torch.arange(6)
    value = _finite_with_grad(ALMNLoss(l2_reg=0.0).train(), x, labels)
    assert value.item() == pytest.approx(
        _finite_with_grad(ALMNLoss(beta=0.0, l2_reg=0.0).train(), x, labels).item()
    )
    # Identical, antipodal, zero and huge embeddings; centres parallel/antiparallel to samples.
    labels = torch.tensor([0, 0, 1, 1])
    row = torch.randn(1, 5, dtype=torch.float64)
    centres = torch.cat([row, -row])
    for embeddings in (row.repeat(4, 1), torch.cat([row, row, -row, -row]), torch.zeros(4, 5), 1e3 * x[:4]):
        _finite_with_grad(ALMNLoss().train(), embeddings, labels)
        _finite_with_grad(_with_centres(centres.clone()).train(), embeddings, labels)
        _finite_with_grad(_with_centres(centres.clone()).train(), 2.0 * embeddings, labels)
    empty = torch.zeros(0, 5, dtype=torch.float64)
    assert _finite_with_grad(ALMNLoss().train(), empty, torch.zeros(0, dtype=torch.long)).item() == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        ALMNLoss()(x[:2], torch.tensor([-1, 0]))


def test_dimension_mismatch_is_an_error() -> None:
    loss = ALMNLoss().train()
    embeddings, labels = _batch(0, classes=2, per_class=2)
    loss(embeddings, labels)
    with pytest.raises(ValueError, match="dimension"):
        loss(torch.randn(4, 3, dtype=torch.float64), labels)
