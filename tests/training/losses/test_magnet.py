"""Magnet loss (Eq. 5) and the kNC classifier (Eq. 6), Rippel et al. 2016.

pytorch-metric-learning has no Magnet loss, so the checks are against a hand-worked example and the
plain-loop references in reference_magnet.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.training.losses.reference_magnet import knc_proba_reference, magnet_loss_reference
from training.losses import LOSSES, build_loss
from training.losses.magnet import KNCClassifier, MagnetLoss


def _neighbourhood_batch(
    generator: torch.Generator,
    clusters: int,
    per_cluster: int,
    dim: int,
    clusters_per_class: int,
    noise: float = 0.7,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M clusters x D examples around random centres, ``clusters_per_class`` consecutive clusters a class."""
    centres = torch.randn(clusters, dim, generator=generator, dtype=torch.float64)
    cluster_ids = torch.arange(clusters).repeat_interleave(per_cluster)
    embeddings = centres[cluster_ids] + noise * torch.randn(
        clusters * per_cluster, dim, generator=generator, dtype=torch.float64
    )
    return embeddings, cluster_ids // clusters_per_class, cluster_ids


def _reference(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    cluster_ids: torch.Tensor | None,
    alpha: float,
    global_scaling: float = 1.0,
) -> float:
    ids = None if cluster_ids is None else cluster_ids.tolist()
    return magnet_loss_reference(embeddings.tolist(), labels.tolist(), ids, alpha, global_scaling)


def test_registry_entry() -> None:
    spec = LOSSES["magnet"]
    assert spec.defaults == {"alpha": 1.0, "variance_momentum": 0.1, "global_scaling": 1.0}
    assert spec.layout.kind == "clusters_x_examples"
    assert (spec.layout.classes, spec.layout.samples_per_class) == (12, 4)
    assert spec.layout.description == "M clusters x D examples"
    loss = build_loss("magnet", alpha=0.5)
    assert isinstance(loss, MagnetLoss) and loss.alpha == 0.5


def test_hand_worked_two_clusters_per_class() -> None:
    # 1-d embeddings, two classes with two clusters of two examples each:
    #   class 0: A = {0, 2} (mu = 1), B = {5, 7} (mu = 6); class 1: C = {2, 4} (mu = 3), E = {8, 10} (mu = 9).
    # Every example is 1 from its cluster mean: sigma^2 = 8 / (8 - 1) = 8/7, so 1/(2 sigma^2) = 7/16.
    # Term = {7/16 * |r - mu(r)|^2 + alpha + log sum_{other-class mu} exp(-7/16 |r - mu|^2)}_+, alpha = 1:
    s = 7 / 16

    def term(impostor_sq: tuple[float, float]) -> float:
        return max(s * 1 + 1.0 + math.log(sum(math.exp(-s * d2) for d2 in impostor_sq)), 0.0)

    expected_terms = [
        term((9, 81)),  # r=0 in A vs C, E (mu 3, 9): 1.4375 - 3.9375 -> 0
        term((1, 49)),  # r=2 in A: 1.4375 - 0.4375 + log(1 + e^-21) ~ 1.0
        term((4, 16)),  # r=5 in B: 1.4375 - 1.75 + log(1 + e^-5.25) ~ -0.307 -> 0
        term((16, 4)),  # r=7 in B: same -> 0
        term((1, 16)),  # r=2 in C vs A, B (mu 1, 6): ~ 1.0014
        term((9, 4)),  # r=4 in C: 1.4375 - 1.75 + log(1 + e^-2.1875) ~ -0.206 -> 0
        term((49, 4)),  # r=8 in E: -> 0
        term((81, 16)),  # r=10 in E: -> 0
    ]
    assert expected_terms[1] == pytest.approx(1.0, abs=1e-9)
    assert expected_terms[4] == pytest.approx(1.0 + math.log1p(math.exp(-6.5625)), abs=1e-12)
    assert sum(t > 0 for t in expected_terms) == 2

    embeddings = torch.tensor([[0.0], [2.0], [5.0], [7.0], [2.0], [4.0], [8.0], [10.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    cluster_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    loss = MagnetLoss(alpha=1.0)
    value = loss(embeddings, labels, cluster_ids=cluster_ids)
    assert value.item() == pytest.approx(sum(expected_terms) / 8, abs=1e-12)
    assert loss.running_variance.item() == pytest.approx(8 / 7)
    torch.testing.assert_close(loss.last_sample_losses, torch.tensor(expected_terms, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("with_cluster_ids", [True, False])
def test_matches_loop_reference(seed: int, with_cluster_ids: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    clusters, per_cluster = [(12, 4), (6, 3), (9, 5), (4, 2), (8, 4)][seed]
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, clusters, per_cluster, 5, clusters_per_class=2)
    ids = cluster_ids if with_cluster_ids else None
    alpha = [1.0, 0.5, 2.0, 1.0, 7.18][seed]
    scaling = [1.0, 8.0, 3.52, 0.5, 14.2][seed]  # Table 1's tuned "global scaling" values among them
    value = MagnetLoss(alpha=alpha, global_scaling=scaling)(embeddings, labels, cluster_ids=ids)
    expected = torch.tensor(_reference(embeddings, labels, ids, alpha, scaling), dtype=torch.float64)
    torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-6)


def test_unequal_clusters_and_singleton_cluster() -> None:
    # A cluster of one example is its own mean (0 to the variance sum); other clusters have 2..5 examples.
    g = torch.Generator().manual_seed(11)
    embeddings = torch.randn(13, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2])
    cluster_ids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 3, 3, 4, 4, 4])
    value = MagnetLoss()(embeddings, labels, cluster_ids=cluster_ids)
    assert torch.isfinite(value)
    torch.testing.assert_close(
        value, torch.tensor(_reference(embeddings, labels, cluster_ids, 1.0), dtype=torch.float64)
    )


def test_cluster_ids_may_be_global_or_local_to_each_class() -> None:
    g = torch.Generator().manual_seed(3)
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, 6, 4, 5, clusters_per_class=2)
    loss = MagnetLoss()
    global_ids = loss(embeddings, labels, cluster_ids=cluster_ids)
    local_ids = loss(embeddings, labels, cluster_ids=cluster_ids % 2)  # 0/1 within each class
    torch.testing.assert_close(global_ids, local_ids)


def test_without_cluster_ids_each_class_is_one_cluster() -> None:
    g = torch.Generator().manual_seed(4)
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, 6, 4, 5, clusters_per_class=2)
    loss = MagnetLoss()
    torch.testing.assert_close(loss(embeddings, labels), loss(embeddings, labels, cluster_ids=labels))
    assert not torch.allclose(loss(embeddings, labels), loss(embeddings, labels, cluster_ids=cluster_ids))


@pytest.mark.parametrize("global_scaling", [1.0, 8.0])
def test_invariant_to_rescaled_embeddings(global_scaling: float) -> None:
    # Variance standardisation (Section 3.1): |r - mu|^2 / sigma^2 is scale-free only with sigma^2 itself
    # in the denominator; dividing by (sigma^2)^2 would change the loss when the embeddings are rescaled.
    g = torch.Generator().manual_seed(5)
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, 12, 4, 6, clusters_per_class=3)
    loss = MagnetLoss(global_scaling=global_scaling)
    base = loss(embeddings, labels, cluster_ids=cluster_ids)
    for factor in (0.01, 3.0, 100.0):
        torch.testing.assert_close(loss(factor * embeddings, labels, cluster_ids=cluster_ids), base)


def test_gradient_flows_through_variance() -> None:
    # sigma^2 carries gradient, so the loss is homogeneous of degree 0 and (Euler) sum_i r_i . dL/dr_i = 0:
    # the gradient never moves along a global rescaling. Detaching sigma^2 would break this.
    g = torch.Generator().manual_seed(6)
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, 12, 4, 6, clusters_per_class=3)
    embeddings.requires_grad_(True)
    MagnetLoss()(embeddings, labels, cluster_ids=cluster_ids).backward()
    assert embeddings.grad.abs().max() > 1e-3
    assert (embeddings.grad * embeddings).sum().abs() < 1e-10


@pytest.mark.parametrize("global_scaling", [1.0, 8.0])
@pytest.mark.parametrize("with_cluster_ids", [True, False])
def test_gradcheck(with_cluster_ids: bool, global_scaling: float) -> None:
    g = torch.Generator().manual_seed(7)
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, 4, 3, 5, clusters_per_class=2)
    ids = cluster_ids if with_cluster_ids else None
    # A large gap keeps most hinge terms active.
    loss = MagnetLoss(alpha=2.0 * global_scaling, global_scaling=global_scaling)
    embeddings.requires_grad_(True)
    assert loss(embeddings, labels, cluster_ids=ids) > 0
    assert torch.autograd.gradcheck(lambda x: loss(x, labels, cluster_ids=ids), (embeddings,))


def test_running_variance_is_an_ema_updated_in_training_only() -> None:
    g = torch.Generator().manual_seed(8)
    loss = MagnetLoss(variance_momentum=0.25, global_scaling=4.0)
    batches = [_neighbourhood_batch(g, 6, 4, 5, clusters_per_class=2) for _ in range(3)]

    def batch_variance(embeddings: torch.Tensor, cluster_ids: torch.Tensor) -> float:
        means = torch.stack([embeddings[cluster_ids == c].mean(0) for c in cluster_ids.unique()])
        return ((embeddings - means[cluster_ids]) ** 2).sum().item() / (len(embeddings) - 1)

    expected = batch_variance(batches[0][0], batches[0][2])  # the first batch initialises it
    for i, (embeddings, labels, cluster_ids) in enumerate(batches):
        loss(embeddings, labels, cluster_ids=cluster_ids)
        if i:
            expected = 0.75 * expected + 0.25 * batch_variance(embeddings, cluster_ids)
        assert loss.running_variance.item() == pytest.approx(expected, rel=1e-6)
    loss.eval()
    loss(batches[0][0] * 10, batches[0][1], cluster_ids=batches[0][2])
    assert loss.running_variance.item() == pytest.approx(expected, rel=1e-6)
    assert int(loss.num_batches_tracked) == 3
    assert loss.kernel_variance == pytest.approx(expected / 4.0, rel=1e-6)  # the loss's own kernel for kNC
    assert set(loss.state_dict()) == {"running_variance", "num_batches_tracked"}


def test_last_sample_losses_average_to_the_loss() -> None:
    g = torch.Generator().manual_seed(9)
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, 12, 4, 6, clusters_per_class=3)
    loss = MagnetLoss()
    value = loss(embeddings, labels, cluster_ids=cluster_ids)
    assert loss.last_sample_losses.shape == (48,) and not loss.last_sample_losses.requires_grad
    torch.testing.assert_close(loss.last_sample_losses.mean(), value.detach())


@pytest.mark.parametrize(
    ("labels", "cluster_ids"),
    [
        ([3, 3, 3, 3, 3, 3], [0, 0, 0, 1, 1, 1]),  # one class, two clusters: no impostor cluster
        ([3, 3, 3, 3, 3, 3], None),  # one cluster only
        ([3], None),  # a single sample
    ],
)
def test_single_class_is_a_defined_zero(labels: list[int], cluster_ids: list[int] | None) -> None:
    embeddings = torch.randn(len(labels), 4, requires_grad=True)
    ids = None if cluster_ids is None else torch.tensor(cluster_ids)
    loss = MagnetLoss()
    value = loss(embeddings, torch.tensor(labels), cluster_ids=ids)
    assert value.item() == 0.0
    value.backward()
    assert torch.equal(embeddings.grad, torch.zeros_like(embeddings))
    assert int(loss.num_batches_tracked) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_degenerate_geometry_is_finite(dtype: torch.dtype) -> None:
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    cases = {
        "all clusters singletons (sigma^2 = 0)": (torch.randn(6, 4, dtype=dtype), labels, torch.arange(6)),
        "all points identical": (torch.ones(6, 4, dtype=dtype), labels, None),
        "pairs of identical points": (torch.randn(3, 4, dtype=dtype).repeat_interleave(2, 0), labels, None),
        "identical across classes": (torch.randn(2, 4, dtype=dtype).repeat(3, 1), labels, None),
        "huge scale": (1e6 * torch.randn(6, 4, dtype=dtype), labels, None),
    }
    for name, (embeddings, case_labels, ids) in cases.items():
        x = embeddings.clone().requires_grad_(True)
        value = MagnetLoss()(x, case_labels, cluster_ids=ids)
        value.backward()
        assert torch.isfinite(value), name
        assert torch.isfinite(x.grad).all(), name


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="cluster_ids"):
        MagnetLoss()(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), cluster_ids=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="embeddings"):
        MagnetLoss()(torch.randn(4, 3), torch.tensor([0, 0, 1]))


# --- kNC classifier, Eq. 6 -----------------------------------------------------------------------


@pytest.mark.parametrize(("num_nearest", "seed"), [(1, 0), (3, 1), (7, 2), (128, 3)])
def test_knc_matches_loop_reference(num_nearest: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(20, 5))
    centre_labels = rng.choice([2, 5, 9, 11], size=20)
    queries = rng.normal(size=(15, 5))
    classifier = KNCClassifier(centres, centre_labels, variance=0.8, num_nearest=num_nearest)
    probs = classifier.predict_proba(queries)
    expected = knc_proba_reference(queries.tolist(), centres.tolist(), list(centre_labels), 0.8, num_nearest)
    np.testing.assert_allclose(probs, np.array(expected), atol=1e-10, rtol=1e-10)
    np.testing.assert_allclose(probs.sum(1), 1.0)
    assert classifier.classes.tolist() == sorted(set(centre_labels.tolist()))
    np.testing.assert_array_equal(classifier.predict(queries), classifier.classes.numpy()[probs.argmax(1)])


def test_knc_arrays_in_arrays_out_and_chunking() -> None:
    rng = np.random.default_rng(1)
    centres, centre_labels = rng.normal(size=(10, 3)).astype(np.float32), rng.integers(0, 3, size=10)
    queries = rng.normal(size=(9, 3)).astype(np.float32)
    whole = KNCClassifier(centres, centre_labels, variance=1.0, num_nearest=4)
    chunked = KNCClassifier(centres, centre_labels, variance=1.0, num_nearest=4, chunk_size=2)
    assert isinstance(whole.predict_proba(queries), np.ndarray)
    assert isinstance(whole.predict(queries), np.ndarray)
    as_tensor = whole.predict_proba(torch.from_numpy(queries))
    assert isinstance(as_tensor, torch.Tensor)
    assert isinstance(whole.predict(torch.from_numpy(queries)), torch.Tensor)
    np.testing.assert_allclose(chunked.predict_proba(queries), as_tensor.numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="variance"):
        KNCClassifier(centres, centre_labels, variance=0.0)


def test_knc_toy_problem_with_multimodal_classes() -> None:
    # Class 0 has two modes at (-4, 0) and (4, 0), class 1 one mode at (0, 0) and one at (0, 5): class 0's
    # mean coincides with a class-1 mode, so one centre per class fails; one centre per cluster does not.
    rng = np.random.default_rng(0)
    modes = np.array([[-4.0, 0.0], [4.0, 0.0], [0.0, 0.0], [0.0, 5.0]])
    mode_labels = np.array([0, 0, 1, 1])

    def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
        mode = np.repeat(np.arange(4), n)
        return modes[mode] + 0.5 * rng.normal(size=(4 * n, 2)), mode

    train, train_mode = sample(50)
    test, test_mode = sample(25)
    variance = 2 * 0.5**2  # expected |r - mu|^2 of the modes' noise: Eq. 5's sigma^2
    knc = KNCClassifier.from_clusters(train, mode_labels[train_mode], train_mode, variance, num_nearest=128)
    assert len(knc.centres) == 4
    assert (knc.predict(test) == mode_labels[test_mode]).all()
    train_labels = mode_labels[train_mode]
    one_per_class = KNCClassifier.from_clusters(train, train_labels, train_labels, variance)
    assert (one_per_class.predict(test) == mode_labels[test_mode]).mean() < 0.9


def test_knc_with_magnet_running_variance() -> None:
    g = torch.Generator().manual_seed(12)
    embeddings, labels, cluster_ids = _neighbourhood_batch(g, 12, 4, 6, clusters_per_class=3, noise=0.2)
    loss = MagnetLoss()
    loss(embeddings, labels, cluster_ids=cluster_ids)
    knc = KNCClassifier.from_clusters(embeddings, labels, cluster_ids, float(loss.running_variance))
    assert isinstance(knc.predict(embeddings), torch.Tensor)
    assert (knc.predict(embeddings) == labels).float().mean() > 0.9
