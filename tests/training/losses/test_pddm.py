"""PDDM unit (Eq. 2) and joint loss (Eqs. 3, 4), Huang et al. 2016.

pytorch-metric-learning has no PDDM, so the checks are against the plain-loop references in
reference_pddm.py (values and gradients), gradcheck, and hand-built graphs for the mining.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch.func import functional_call

from tests.training.losses.reference_pddm import pddm_loss_reference, pddm_score_reference
from training.losses import LOSSES, build_loss
from training.losses import pddm as pddm_module
from training.losses.pddm import PDDMLoss, PDDMUnit, graph_extremes, hard_quadruplets

MODES = ["batch", "per_class", "per_sample"]


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Thousands of tiny float64 forwards (gradcheck): one thread avoids OpenMP hand-offs on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _loss(dim: int, hidden: int, mode: str, seed: int = 0, dropout: float = 0.0) -> PDDMLoss:
    torch.manual_seed(seed)
    return PDDMLoss(embedding_dim=dim, hidden=hidden, dropout=dropout, quadruplets=mode).double()


def _batch(seed: int, classes: int, per_class: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=generator)]
    return torch.randn(len(labels), dim, generator=generator, dtype=torch.float64), labels


def _reference(
    loss: PDDMLoss, embeddings: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor | None = None
) -> torch.Tensor:
    params = dict(loss.unit.named_parameters())
    return pddm_loss_reference(
        embeddings,
        labels.tolist(),
        params,
        loss.alpha,
        loss.beta,
        loss.lam,
        loss.quadruplets,
        masks,
    )


def test_registry_entry() -> None:
    spec = LOSSES["pddm"]
    assert spec.defaults == {
        "embedding_dim": 128,
        "hidden": 128,
        "dropout": 0.5,
        "alpha": 0.5,
        "beta": 1.0,
        "lam": 0.5,
        "quadruplets": "batch",
    }
    assert spec.layout.kind == "classes_x_samples"
    assert (spec.layout.classes, spec.layout.samples_per_class) == (16, 4)
    loss = build_loss("pddm", embedding_dim=32, hidden=16, quadruplets="per_class")
    assert isinstance(loss, PDDMLoss) and loss.quadruplets == "per_class"
    assert (loss.unit.dim, loss.unit.hidden) == (32, 16)
    # The unit's parameters are the loss's parameters: the optimiser trains them with the embedding head.
    assert {name for name, _ in loss.named_parameters()} == {
        f"unit.fc_{layer}.{kind}" for layer in "uvcs" for kind in ("weight", "bias")
    }
    with pytest.raises(ValueError):
        build_loss("pddm", quadruplets="all")


def test_unit_matches_reference_and_layer_shapes() -> None:
    torch.manual_seed(0)
    unit = PDDMUnit(5, 7).double()
    shapes = {name: tuple(p.shape) for name, p in unit.named_parameters()}
    assert shapes == {
        "fc_u.weight": (7, 5),
        "fc_u.bias": (7,),
        "fc_v.weight": (7, 5),
        "fc_v.bias": (7,),
        "fc_c.weight": (7, 14),
        "fc_c.bias": (7,),
        "fc_s.weight": (1, 7),
        "fc_s.bias": (1,),
    }
    params = dict(unit.named_parameters())
    a, b = torch.randn(2, 6, 5, dtype=torch.float64)
    expected = torch.stack([pddm_score_reference(a[n], b[n], params) for n in range(6)])
    torch.testing.assert_close(unit(a, b), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block_elements", [1 << 24, 40])
def test_similarity_graph_matches_reference(monkeypatch: pytest.MonkeyPatch, block_elements: int) -> None:
    monkeypatch.setattr(pddm_module, "_GRAPH_BLOCK_ELEMENTS", block_elements)  # 40: one row per block
    monkeypatch.setattr(pddm_module, "_GRAPH_MIN_ROWS", 1)
    torch.manual_seed(1)
    unit = PDDMUnit(4, 6).double()
    params = dict(unit.named_parameters())
    x = torch.randn(9, 4, dtype=torch.float64)
    expected = torch.tensor(
        [[pddm_score_reference(x[i], x[j], params).item() for j in range(9)] for i in range(9)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(unit.similarity_graph(x), expected, rtol=1e-6, atol=1e-6)


def _graph_block(unit: PDDMUnit, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    return unit.similarity_graph(torch.cat((rows, cols)))[: len(rows), len(rows) :]


def test_score_is_symmetric_and_shapes() -> None:
    torch.manual_seed(2)
    unit = PDDMUnit(8, 16).double()
    a, b = torch.randn(2, 30, 8, dtype=torch.float64)
    assert torch.equal(unit(a, b), unit(b, a))  # bit for bit
    graph = unit.similarity_graph(a)
    assert torch.equal(graph, graph.T)

    queries, candidates = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    scores = unit.score(queries, candidates)
    assert scores.shape == (3, 5)
    # S(q, c) == S(c, q): score each candidate as the query against its query as the candidate.
    swapped = unit.score(candidates.reshape(15, 8), queries.repeat_interleave(5, dim=0).unsqueeze(1))
    torch.testing.assert_close(swapped.reshape(3, 5), scores, rtol=1e-12, atol=1e-12)
    shared = unit.score(queries, candidates[0])  # one candidate set for every query
    assert shared.shape == (3, 5)
    torch.testing.assert_close(shared[1], unit(queries[1].expand(5, 8), candidates[0]))
    torch.testing.assert_close(shared, _graph_block(unit, queries, candidates[0]))


def test_hard_quadruplets_on_hand_built_graph() -> None:
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    graph = torch.full((6, 6), 0.5, dtype=torch.float64)

    def link(i: int, j: int, s: float) -> None:
        graph[i, j] = graph[j, i] = s

    # Positive pairs: (0,1)=.9, (0,2)=.3, (1,2)=.8 in class 0; (3,4)=.2 in class 1; class 2 has none.
    link(0, 1, 0.9), link(0, 2, 0.3), link(1, 2, 0.8), link(3, 4, 0.2)
    link(3, 0, 0.7), link(4, 5, 0.95), link(0, 5, 0.85), link(2, 4, 0.6), link(3, 5, 0.1)
    quadruplet = hard_quadruplets(graph, labels)
    # Least similar positive (3,4); 3's most similar negative 0 (.7), 4's is 5 (.95).
    assert [t.tolist() for t in quadruplet] == [[3], [4], [0], [5]]
    quadruplets = hard_quadruplets(graph, labels, "per_class")
    # Class 0: (0,2); 0's hardest negative 5 (.85), 2's is 4 (.6). Class 1 as above. Class 2: none.
    assert [t.tolist() for t in quadruplets] == [[0, 3], [2, 4], [5, 0], [4, 5]]
    per_sample = hard_quadruplets(graph, labels, "per_sample")
    # Every sample with a positive is an i^: 0 -> (0,2), 1 -> (1,2) (.8 < .9), 2 -> (2,0), 3 -> (3,4),
    # 4 -> (4,3); 5 has none. 1's negatives all score .5: the tie goes to the first, 3.
    assert [t.tolist() for t in per_sample] == [
        [0, 1, 2, 3, 4],
        [2, 2, 0, 4, 3],
        [5, 3, 4, 0, 5],
        [4, 4, 5, 5, 0],
    ]
    rows, cols = graph_extremes(graph)
    assert (rows.tolist(), cols.tolist()) == ([3, 4], [5, 5])  # min (3,5)=.1, max (4,5)=.95


@pytest.mark.parametrize("mode", MODES)
def test_matches_loop_reference(mode: str) -> None:
    for seed, (classes, per_class) in enumerate([(3, 4), (4, 3), (2, 5), (5, 2)]):
        loss = _loss(5, 6, mode, seed)
        embeddings, labels = _batch(seed, classes, per_class, 5)
        embeddings.requires_grad_(True)
        params = list(loss.parameters())
        ours = loss(embeddings, labels)
        expected = _reference(loss, embeddings, labels)
        assert ours.item() > 0
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
        ours_grads = torch.autograd.grad(ours, [embeddings, *params])
        expected_grads = torch.autograd.grad(expected, [embeddings, *params])
        for got, want in zip(ours_grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_per_class_and_per_sample_hold_the_batch_quadruplet() -> None:
    loss = _loss(5, 6, "per_class", seed=3)
    embeddings, labels = _batch(3, 4, 4, 5)
    graph = loss.unit.similarity_graph(embeddings)
    batch = torch.stack(hard_quadruplets(graph, labels))
    per_class = torch.stack(hard_quadruplets(graph, labels, "per_class"))
    per_sample = torch.stack(hard_quadruplets(graph, labels, "per_sample"))
    assert per_class.shape == (4, 4) and per_sample.shape == (4, 16)  # one per class, one per sample
    assert batch[:, 0].tolist() in per_class.T.tolist()
    assert set(map(tuple, per_class.T.tolist())) <= set(map(tuple, per_sample.T.tolist()))
    assert torch.equal(labels[per_class[0]], labels.unique())
    assert (labels[per_class[0]] == labels[per_class[1]]).all()
    assert (labels[per_class[0]] != labels[per_class[2]]).all()
    assert (labels[per_class[1]] != labels[per_class[3]]).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.usefixtures("single_thread")
def test_gradcheck_embeddings_and_unit_parameters(mode: str) -> None:
    loss = _loss(4, 5, mode, seed=4)
    embeddings, labels = _batch(4, 3, 3, 4)
    names = [name for name, _ in loss.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in loss.parameters())
    embeddings.requires_grad_(True)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return functional_call(loss, dict(zip(names, weights, strict=True)), (x, labels))

    assert fn(embeddings, *params).item() > 0
    assert torch.autograd.gradcheck(fn, (embeddings, *params), eps=1e-6, atol=1e-5)


def test_affine_rescaling_of_scores_leaves_loss_unchanged() -> None:
    # The [0, 1] scaling over the batch graph makes the loss blind to S -> a S + b (a > 0).
    loss = _loss(5, 6, "batch", seed=5)
    embeddings, labels = _batch(5, 4, 4, 5)
    before = loss(embeddings, labels)
    with torch.no_grad():
        loss.unit.fc_s.weight.mul_(7.0)
        loss.unit.fc_s.bias.mul_(7.0).add_(-3.0)
    torch.testing.assert_close(loss(embeddings, labels), before, rtol=1e-9, atol=1e-9)


def test_dropout_uses_one_mask_per_batch() -> None:
    loss = _loss(5, 32, "per_class", seed=6, dropout=0.5)  # wide: few ReLU-dead ties
    embeddings, labels = _batch(6, 4, 4, 5)
    torch.manual_seed(11)
    masks = loss.unit.sample_dropout(embeddings)
    assert masks is not None and masks.shape == (3, 32) and set(masks.unique().tolist()) <= {0.0, 2.0}
    torch.manual_seed(11)
    ours = loss(embeddings, labels)  # samples the same masks first thing
    torch.testing.assert_close(ours, _reference(loss, embeddings, labels, masks), rtol=1e-6, atol=1e-6)
    loss.eval()  # the full unit, no masks
    assert loss.unit.sample_dropout(embeddings) is None
    torch.testing.assert_close(loss(embeddings, labels), _reference(loss, embeddings, labels))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "labels",
    [[3], [1, 1, 1, 1], [0, 1, 2, 3, 4]],
    ids=["single-sample", "one-class", "no-positive-pair"],
)
def test_degenerate_batches_give_connected_zero(mode: str, labels: list[int]) -> None:
    loss = _loss(4, 5, mode, seed=7)
    embeddings = torch.randn(len(labels), 4, dtype=torch.float64, requires_grad=True)
    value = loss(embeddings, torch.tensor(labels))
    assert value.item() == 0.0
    value.backward()
    assert embeddings.grad is not None and torch.equal(embeddings.grad, torch.zeros_like(embeddings))
    assert all(p.grad is not None for p in loss.parameters())  # connected, e.g. for DDP


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["identical", "antipodal", "zero-rows"])
def test_no_nan_for_coinciding_or_zero_inputs(mode: str, case: str) -> None:
    loss = _loss(4, 5, mode, seed=8)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    base = torch.randn(1, 4, dtype=torch.float64)
    embeddings = {
        "identical": base.repeat(6, 1),
        "antipodal": torch.cat((base, base, -base, -base, base, -base)),
        "zero-rows": torch.cat((torch.zeros(2, 4), torch.randn(4, 4))).double(),
    }[case].requires_grad_(True)
    value = loss(embeddings, labels)
    value.backward()
    assert math.isfinite(value.item())
    assert torch.isfinite(embeddings.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in loss.parameters())
    if case == "identical":  # every pair scores the same: scaled scores 0, E_m = 2 alpha, E_e = 2 beta
        assert value.item() == pytest.approx(2 * loss.alpha + loss.lam * 2 * loss.beta)


def test_dead_relus_give_a_constant_graph_and_finite_gradients() -> None:
    # Every ReLU of the u and v branches off: u' = v' = 0 (r(0) = 0), so every pair scores the same.
    loss = _loss(4, 5, "batch", seed=10)
    with torch.no_grad():
        loss.unit.fc_u.bias.fill_(-100.0)
        loss.unit.fc_v.bias.fill_(-100.0)
    embeddings, labels = _batch(10, 3, 3, 4)
    embeddings.requires_grad_(True)
    graph = loss.unit.similarity_graph(embeddings)
    assert torch.equal(graph, graph[0, 0].expand_as(graph))
    value = loss(embeddings, labels)
    value.backward()
    assert math.isfinite(value.item()) and torch.isfinite(embeddings.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in loss.parameters())


def test_paper_layout_float32_batch() -> None:
    spec = LOSSES["pddm"]
    loss = build_loss("pddm", embedding_dim=32)
    embeddings, labels = _batch(9, spec.layout.classes, spec.layout.samples_per_class, 32)
    embeddings = embeddings.float().requires_grad_(True)
    value = loss(embeddings, labels)
    value.backward()
    assert value.dtype == torch.float32 and math.isfinite(value.item()) and value.item() > 0
    assert loss.unit.fc_u.weight.grad is not None and loss.unit.fc_u.weight.grad.abs().sum() > 0


def test_rejects_wrong_shapes() -> None:
    loss = _loss(4, 5, "batch")
    with pytest.raises(ValueError):
        loss(torch.randn(6, 3, dtype=torch.float64), torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError):
        loss(torch.randn(6, 4, dtype=torch.float64), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError):
        PDDMUnit(4, 5, dropout=1.0)
