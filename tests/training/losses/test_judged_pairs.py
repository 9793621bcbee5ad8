"""Judged pairs (issue 40, part 3): every pair-based loss trains from a person's 👍 and 👎 through one call,
``loss(embeddings, labels, pair_signs=signs)``, and a judgment outweighs what the labels say."""

from __future__ import annotations

import pytest
import torch

from training.losses import LOSSES, build_loss
from training.losses.pairs import PAIR_SIGNS, UNLABELLED, label_masks, pair_masks

# The paper losses built on pairs and triplets that issue 40 names, and the baselines beside them.
JUDGED_LOSSES = sorted(name for name, spec in LOSSES.items() if spec.judged_pairs)
DIM = 16


def test_the_losses_issue_40_names_read_judged_pairs() -> None:
    named = {
        "pddm",
        "angular",
        "npair-angular",
        "loop-triplet",
        "loop-hphn-triplet",
        "loop-lifted",
        "loop-ms",
    }
    assert named | {"lifted", "ms", "triplet"} <= set(JUDGED_LOSSES)
    # the losses whose batches are classes or clusters, not pairs, do not claim to
    assert not {"magnet", "almn", "npair"} & set(JUDGED_LOSSES)


def test_without_judgments_the_masks_are_the_labels() -> None:
    labels = torch.randint(0, 4, (12,), generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(pair_masks(labels, {}), label_masks(labels), strict=True):
        assert torch.equal(ours, theirs)


def test_a_judgment_outweighs_the_labels() -> None:
    labels = torch.tensor([0, 0, 1, 1, UNLABELLED, UNLABELLED])
    signs = torch.zeros(6, 6, dtype=torch.int8)
    for a, b, sign in ((0, 1, -1), (1, 2, 1), (4, 5, 1), (0, 4, -1), (3, 3, 1)):
        signs[a, b] = signs[b, a] = sign
    positive, negative = pair_masks(labels, {PAIR_SIGNS: signs})
    assert negative[0, 1] and not positive[0, 1]  # a 👎 on two photos of one (pseudo-)class
    assert positive[1, 2] and not negative[1, 2]  # a 👍 on two photos of different (pseudo-)classes
    assert positive[4, 5] and negative[0, 4] and negative[4, 0]  # unlabelled rows pair where judged
    assert not (positive[3, 4] or negative[3, 4] or positive[2, 5] or negative[2, 5])  # and nowhere else
    assert positive[2, 3] and negative[0, 2]  # unjudged labelled pairs keep their labels' say
    assert not (positive.diagonal().any() or negative.diagonal().any())


def judged_toy() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight unlabelled photos in four 👍 pairs (rows 0-1, 2-3, ...: LoOp's layout) and 👎 between the pairs
    of a query's results: every pair is known only from a judgment."""
    labels = torch.full((8,), UNLABELLED)
    signs = torch.zeros(8, 8, dtype=torch.int8)
    for first in range(0, 8, 2):
        signs[first, first + 1] = signs[first + 1, first] = 1
    for a in range(8):
        for b in range(8):
            if a // 2 != b // 2:
                signs[a, b] = -1
    return labels, signs


def build(name: str) -> torch.nn.Module:
    return build_loss(name, embedding_dim=DIM, dropout=0.0) if name == "pddm" else build_loss(name)


@pytest.mark.parametrize("name", JUDGED_LOSSES)
def test_each_pair_loss_trains_on_judgments(name: str) -> None:
    torch.manual_seed(0)
    labels, signs = judged_toy()
    loss = build(name)
    # The judged positive pairs start far apart, each photo nearer another pair's (a 👎).
    start = torch.randn(8, DIM)
    start[1::2] = -start[0::2] + 0.3 * torch.randn(4, DIM)
    x = torch.nn.Parameter(start.clone())
    value = loss(x, labels, **{PAIR_SIGNS: signs})
    assert torch.isfinite(value) and value > 0
    value.backward()
    assert x.grad is not None and x.grad.abs().sum() > 0

    def positive_cosine(embeddings: torch.Tensor) -> float:
        unit = torch.nn.functional.normalize(embeddings.detach(), dim=1)
        return float((unit[0::2] * unit[1::2]).sum(1).mean())

    before = positive_cosine(x)
    optimiser = torch.optim.Adam([x, *loss.parameters()], lr=0.05)
    for _ in range(40):
        optimiser.zero_grad()
        loss(x, labels, **{PAIR_SIGNS: signs}).backward()
        optimiser.step()
    assert positive_cosine(x) > before + 0.2, (name, before, positive_cosine(x))


@pytest.mark.parametrize("name", ["triplet", "lifted", "ms", "pddm", "npair-angular"])
def test_a_thumbs_down_gives_a_one_class_batch_something_to_learn(name: str) -> None:
    """Pseudo-labels put four photos in one cluster, so the labels alone make no negative pair (a zero
    loss); the judgments say photos 0-1 and 2-3 are alike and 1 is not 2: now there is a loss to learn."""
    torch.manual_seed(1)
    labels = torch.zeros(4, dtype=torch.long)
    x = torch.nn.Parameter(torch.randn(4, DIM))
    loss = build(name)
    assert float(loss(x, labels).detach()) == pytest.approx(0.0, abs=1e-6)
    signs = torch.zeros(4, 4, dtype=torch.int8)
    signs[1, 2] = signs[2, 1] = -1
    signs[0, 3] = signs[3, 0] = -1
    value = loss(x, labels, **{PAIR_SIGNS: signs})
    value.backward()
    assert torch.isfinite(value) and x.grad is not None and x.grad.abs().sum() > 0
