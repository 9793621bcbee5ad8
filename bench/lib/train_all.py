"""The methods bench/train_all.py trains, the peers from pytorch-metric-learning among them, and the run of
one method with the recipe's config (tested: tests/training)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners

from training.comparison import validation_gain
from training.config import Mode
from training.losses import LOSSES, MetricLoss, register_loss
from training.recipes import (
    RecipeName,
    Resolved,
    format_values,
    parse_assignments,
    recipe,
    resolve,
)
from training.trainer import train


class PMLMultiSimilarity(MetricLoss):
    """pytorch-metric-learning's MultiSimilarityLoss with its MultiSimilarityMiner, the MS paper's setup."""

    def __init__(
        self, alpha: float = 2.0, beta: float = 50.0, base: float = 0.5, epsilon: float = 0.1
    ) -> None:
        super().__init__()
        self.loss = pml_losses.MultiSimilarityLoss(alpha=alpha, beta=beta, base=base)
        self.miner = pml_miners.MultiSimilarityMiner(epsilon=epsilon)

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        return self.loss(embeddings, labels, self.miner(embeddings, labels))


class PMLAngular(MetricLoss):
    """pytorch-metric-learning's AngularLoss at the Angular paper's alpha (pml's own default is 40)."""

    def __init__(self, alpha: float = 45.0) -> None:
        super().__init__()
        self.loss = pml_losses.AngularLoss(alpha=alpha)

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor
    ) -> torch.Tensor:
        return self.loss(embeddings, labels)


def register_peers() -> None:
    """Add the pytorch-metric-learning peers to the registry, with the batch layouts of our versions."""
    if "pml-ms" not in LOSSES:
        register_loss(
            "pml-ms",
            PMLMultiSimilarity,
            layout=LOSSES["ms"].layout,
            paper="pytorch-metric-learning 2.9 MultiSimilarityLoss + MultiSimilarityMiner",
            summary="peer: pml's multi-similarity loss",
        )
    if "pml-angular" not in LOSSES:
        register_loss(
            "pml-angular",
            PMLAngular,
            layout=LOSSES["angular"].layout,
            paper="pytorch-metric-learning 2.9 AngularLoss",
            summary="peer: pml's angular loss",
        )


@dataclass(frozen=True)
class Method:
    """One row: a registered loss trained with its recipe (training/recipes.py), plus any overrides."""

    label: str
    loss: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def run_name(self) -> str:
        return "".join(char if char.isalnum() or char in "-_." else "_" for char in self.label)

    def resolved(self, recipe_name: RecipeName, budget: dict[str, Any], mode: Mode) -> Resolved:
        return resolve(self.loss, recipe_name, {**budget, **self.overrides}, mode)

    def describe(self, recipe_name: RecipeName, mode: Mode, given: list[str]) -> str:
        """What the row trained with: the recipe's values, the row's overrides, ``--set`` ones on top."""
        values = {key: choice.value for key, choice in recipe(self.loss, recipe_name, mode).items()}
        return format_values({**values, **self.overrides, **parse_assignments(self.loss, given)})


def all_methods() -> list[Method]:
    methods = []
    for name in sorted(LOSSES):
        if name.startswith("pml-"):
            continue
        if name == "almn":  # the paper's baseline (beta = 0, Eq. 3) beside its method (beta > 0)
            methods.append(Method("almn (beta=0)", name, {"beta": 0.0}))
        methods.append(Method(name, name))
    return [*methods, Method("pml-ms (peer)", "pml-ms"), Method("pml-angular (peer)", "pml-angular")]


def run_method(method: Method, args: argparse.Namespace) -> dict[str, Any]:
    resolved = method.resolved(args.recipe, budget_overrides(args, method.loss), args.mode)
    config = resolved.config(
        method.loss,
        str(args.data.resolve()),
        cache_dir=str(args.cache_dir.resolve()),
        device=args.device,
        seed=args.seed,
    )
    path = args.runs_dir / args.mode / args.recipe / method.run_name
    finished_before = (path / "summary.json").exists()
    started = time.perf_counter()
    summary = train(config, path, progress=True)
    # Wall time of the whole run (features from the cache, validation and test included); none for a run
    # finished before this invocation.
    wall = None if finished_before else round(time.perf_counter() - started)
    gain = validation_gain(path)  # as the trainer recorded it, or computed for a run finished before that
    return {
        "method": method.label,
        "loss": method.loss,
        "settings": method.describe(args.recipe, args.mode, args.set),
        **summary.to_dict(),
        "beats_backbone": gain.improved,
        "validation_gain": gain.interval.to_dict(),
        "wall_seconds": wall,
    }


def budget_overrides(args: argparse.Namespace, loss: str) -> dict[str, Any]:
    """What the command line sets over every recipe: the budget flags given and ``--set`` values."""
    given = {key: getattr(args, key) for key in ("max_steps", "patience") if getattr(args, key) is not None}
    if args.time_budget is not None:
        given["time_budget"] = 60 * args.time_budget
    return {**given, **parse_assignments(loss, args.set)}
