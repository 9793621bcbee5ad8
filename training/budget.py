"""Which mode fits a time budget on this machine, and how many steps: ``dmlsearch train`` on a CPU.

Fine-tuning is the largest lever the project has (docs/measurements.md), but on a CPU it costs minutes per
epoch. So where no mode is given, the speed of a fine-tuning step is measured on this machine (random images
at the run's batch and compute; the fastest of :data:`TIMED_STEPS` steps, so that a passing load does not
decide an hour's run; the load average read beside it is said when the machine looked busy) and fine-tuning is
chosen when at least :data:`MIN_FINETUNE_STEPS` steps, plus validating and testing, fit in the budget;
otherwise the frozen mode. The steps then fill the budget, up to the recipe's ``max_steps``, and the run stops
at the budget in any case (``TrainConfig.time_budget``).
A ``frozen_first`` run's frozen stage is counted too, from a head step measured the same way.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from foundation.stopping import checkpoint
from training.backbone import BACKBONES
from training.config import TrainConfig
from training.data import load_labelled_images, split_classes
from training.feedback_data import load_feedback
from training.label_free_data import label_free_images, plan_label_free
from training.losses import LOSSES
from training.model import build_objective
from training.precision import model_inputs, resolve_compute
from training.pseudo_labels import FINETUNE_REFRESH_EPOCHS

# The fewest fine-tuning steps worth choosing over the frozen mode: what a measured run took to gain
# most of fine-tuning's lead (docs/measurements.md).
MIN_FINETUNE_STEPS = 150
# A forward pass costs about a third of a training step (forward + backward): what embedding the
# validation and test images (twice: trained and untrained) is estimated at.
FORWARD_SHARE = 1 / 3
# Timed steps of a speed measurement, after an untimed warm-up; the fastest counts: other work slows some
# steps, not the machine (docs/measurements.md).
TIMED_STEPS = 3

Clock = Callable[[], float]


@dataclass(frozen=True)
class Load:
    """The 1-minute load average when a speed was measured, against the cores this process may use."""

    average: float
    cores: int

    @classmethod
    def now(cls) -> Load:
        return cls(os.getloadavg()[0], len(os.sched_getaffinity(0)))

    @property
    def busy(self) -> bool:
        """More runnable work than cores: every process, the measured steps too, waited for a core."""
        return self.average > self.cores

    def describe(self) -> str:
        return (
            f"the machine looked busy, load average {self.average:.1f} on {self.cores} cores, so the "
            "measured speed may be low: measure again when it is quiet, or give --mode"
        )


@dataclass(frozen=True)
class Plan:
    mode: str
    max_steps: int
    reason: str


def measure_finetune_speed(
    config: TrainConfig, batch: int, *, steps: int = TIMED_STEPS, clock: Clock = time.perf_counter
) -> float:
    """Images per second of ``config``'s fine-tuning step on this CPU (the fastest of ``steps``, after a
    warm-up step): the run's own objective, precision and memory format on random images."""
    finetune = config.model_copy(update={"mode": "finetune"})
    compute = resolve_compute(finetune.precision, finetune.channels_last, torch.device("cpu"))
    objective = compute.prepare_module(build_objective(finetune, BACKBONES[config.backbone].feature_dim))
    objective.train()
    size = config.train_size or BACKBONES[config.backbone].preprocessing.input_size
    images = model_inputs(torch.randn(batch, 3, size, size), compute.channels_last)
    labels = torch.arange(batch) // 4  # classes of 4 images
    return batch / _seconds_per_step(objective, images, labels, steps, clock, compute.autocast_context)


def measure_head_speed(
    config: TrainConfig, batch: int, *, steps: int = 5, clock: Clock = time.perf_counter
) -> float:
    """Steps per second of the frozen mode's step (head and loss on cached features) on this CPU, the
    fastest of ``steps`` after a warm-up step: what a ``frozen_first`` run's frozen stage trains with."""
    frozen = config.model_copy(update={"mode": "frozen", "frozen_first": False})
    feature_dim = BACKBONES[config.backbone].feature_dim
    objective = build_objective(frozen, feature_dim).train()
    features = torch.randn(batch, feature_dim)
    labels = torch.arange(batch) // 4
    return 1 / _seconds_per_step(objective, features, labels, steps, clock)


def _seconds_per_step(
    objective: torch.nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    clock: Clock,
    forward_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> float:
    """Seconds of the fastest of ``steps`` training steps (forward in ``forward_context``, backward,
    Adam) after an untimed warm-up step: the machine's speed, less what other work took of it."""
    optimizer = torch.optim.Adam(objective.parameters(), lr=1e-9)
    timed = []
    for _ in range(steps + 1):
        checkpoint()  # a step of a loaded CPU takes a minute or more: SIGTERM must not wait for them all
        started = clock()
        with forward_context():
            value = objective(inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        timed.append(clock() - started)
    return min(timed[1:])


def finetune_seconds(
    steps: int, *, img_per_s: float, batch: int, images: dict[str, int], eval_area: float = 1.0
) -> float:
    """Estimated seconds of a fine-tuning run: its steps, a validation per epoch of training images and
    at the start and the end, the test images, and the backbone features of all images (cached once).
    ``eval_area``: pixels of an evaluated image over those of a training crop (``train_size``)."""
    forward_per_s = img_per_s / FORWARD_SHARE / eval_area
    validations = 2 + steps * batch / max(1, images["train"])
    evaluated = validations * images["val"] + images["test"] + sum(images.values())
    return steps * batch / img_per_s + evaluated / forward_per_s


@dataclass(frozen=True)
class Speed:
    """A fine-tuning step measured on this CPU, and the images a run of it trains on and evaluates."""

    img_per_s: float
    batch: int
    images: dict[str, int]  # train / val / test
    eval_area: float  # pixels of an evaluated image over those of a training crop
    frozen_stage_s: float = 0.0  # a frozen_first run's frozen stage at its full step budget (0: none)
    load: Load | None = None  # the load average when the step was measured

    def seconds(self, steps: int) -> float:
        fine_tuning = finetune_seconds(
            steps, img_per_s=self.img_per_s, batch=self.batch, images=self.images, eval_area=self.eval_area
        )
        return self.frozen_stage_s + fine_tuning

    def steps_within(self, step_seconds: float) -> int:
        """How many steps ``step_seconds`` of training steps hold (what ``time_budget`` counts)."""
        return math.floor(step_seconds * self.img_per_s / self.batch)

    def describe(self) -> str:
        text = f"a fine-tuning step of {self.batch} images measured at {self.img_per_s:.1f} img/s on this CPU"
        if self.frozen_stage_s:
            text += f"; a frozen stage of at most {self.frozen_stage_s / 60:.0f} minutes first"
        if self.load is not None and self.load.busy:
            text += f"; {self.load.describe()}"
        return text


def plan_mode(speed: Speed, *, budget_s: float, max_steps: int) -> Plan:
    """Fine-tune when :data:`MIN_FINETUNE_STEPS` steps (or ``max_steps``, if fewer) fit in ``budget_s``,
    with as many steps as fit, at most ``max_steps``; else the frozen mode."""
    cost = speed.seconds

    per_step = cost(1) - cost(0)
    steps = min(max_steps, max(0, math.floor((budget_s - cost(0)) / per_step)))
    minutes = f"{budget_s / 60:.0f}-minute budget"
    fewest = min(MIN_FINETUNE_STEPS, max_steps)
    if steps >= fewest:
        reason = (
            f"finetune: {steps} steps fit the {minutes} (about {cost(steps) / 60:.0f} minutes; "
            f"{speed.describe()})"
        )
        return Plan("finetune", steps, reason)
    reason = (
        f"frozen: {fewest} fine-tuning steps would take about "
        f"{cost(fewest) / 60:.0f} minutes, over the {minutes} ({speed.describe()}); "
        "raise --time-budget to fine-tune"
    )
    return Plan("frozen", max_steps, reason)


def measure(config: TrainConfig, *, clock: Clock = time.perf_counter, load: Load | None = None) -> Speed:
    """The speed of ``config``'s fine-tuning step on this CPU, with its data's split sizes and the load
    average (``load``: read now unless given)."""
    load = load or Load.now()  # before measuring: the measurement's own steps load the machine
    layout = LOSSES[config.loss].layout
    batch = (config.classes_per_batch or layout.classes) * (
        config.samples_per_class or layout.samples_per_class
    )
    images = split_sizes(config)
    input_size = BACKBONES[config.backbone].preprocessing.input_size
    eval_area = (input_size / (config.train_size or input_size)) ** 2
    frozen_stage_s = 0.0
    if config.frozen_first:  # the stage runs the frozen mode's step budget (trainer.frozen_stage)
        max_steps = TrainConfig.model_fields["max_steps"].default
        frozen_stage_s = max_steps / measure_head_speed(config, batch, clock=clock)
    img_per_s = measure_finetune_speed(config, batch, clock=clock)
    return Speed(img_per_s, batch, images, eval_area, frozen_stage_s, load)


def split_sizes(config: TrainConfig) -> dict[str, int]:
    """Images of each split that a run of ``config`` trains on, validates and tests: a label-free run's
    held-out photos count twice (as served and as an augmented view), its pseudo-label refreshes embed
    the training photos again, counted as that many more validation images, its gate's neighbourhood
    check embeds them once more at the end with a strong view of each validation photo, and the copy
    finder decodes every photo for its perceptual signature, both counted with the test images. Judgments
    (``feedback``) add their photos (:func:`judged_split_sizes`)."""
    if config.data is None:
        return judged_split_sizes(config, {"train": 0, "val": 0, "test": 0})
    sizes = _folder_split_sizes(config)
    return sizes if config.feedback is None else judged_split_sizes(config, sizes)


def judged_split_sizes(config: TrainConfig, sizes: dict[str, int]) -> dict[str, int]:
    """``sizes`` with the judged photos of ``config.feedback``: its training judgments' photos train (at
    most: one that is a folder's training photo keeps its row), the validation judgments' validate, and
    the gate embeds the held-out judgments' photos and the unjudged sample as served and as a view."""
    assert config.feedback is not None
    feedback = load_feedback(Path(config.feedback), seed=config.seed, validation=config.data is None)
    held_out = len(feedback.items(feedback.test))
    return {
        "train": sizes["train"] + len(feedback.items(feedback.train)),
        "val": sizes["val"] + len(feedback.items(feedback.val)),
        # without a folder the held-out photos are the test split too
        "test": sizes["test"] + held_out * (1 if config.data is not None else 2) + 2 * len(feedback.unjudged),
    }


def _folder_split_sizes(config: TrainConfig) -> dict[str, int]:
    assert config.data is not None
    loose = label_free_images(Path(config.data), config.labels)
    if loose is None:
        split = split_classes(
            load_labelled_images(Path(config.data)),
            train_classes=config.train_classes,
            val_fraction=config.val_fraction,
            fold=config.fold,
            folds=config.folds,
        )
        return {name: len(split[name]) for name in ("train", "val", "test")}
    plan = plan_label_free(loose, seed=config.seed)
    # A refresh every FINETUNE_REFRESH_EPOCHS epochs embeds the training photos: per epoch (a validation),
    # that many more evaluated images.
    refreshed = math.ceil(len(plan.train) / FINETUNE_REFRESH_EPOCHS)
    gate = len(plan.train) + len(plan.val)  # the trainer's _neighbourhood_check
    # The copy finder's perceptual signatures decode every photo once more (training.copies), counted as
    # one evaluated image each: a camera photo's decode costs about a forward pass, a small one's a fifth
    # (bench/results/build_speed_signatures.md). Counted as the features are, cached or not.
    signed = len(loose)
    return {
        "train": len(plan.train),
        "val": 2 * len(plan.val) + refreshed,
        "test": 2 * len(plan.test) + gate + signed,
    }


def plan_for(config: TrainConfig, budget_s: float) -> Plan:
    """:func:`plan_mode` for ``config``'s data and batch, with the step speed measured here."""
    return plan_mode(measure(config), budget_s=budget_s, max_steps=config.max_steps)


def estimate(config: TrainConfig) -> str:
    """What a fine-tuning run of ``config`` will take on this CPU, measured: said before it starts."""
    speed = measure(config)
    steps = config.max_steps
    if config.time_budget is not None:
        steps = min(steps, speed.steps_within(config.time_budget))
    text = f"estimate: about {speed.seconds(steps) / 60:.0f} minutes for {steps} steps ({speed.describe()})"
    if config.time_budget is not None and steps < config.max_steps:  # fewer steps: the budget bound
        text += (
            f"; the time budget's {config.time_budget / 60:.0f} minutes of steps hold {steps} of the "
            f"{config.max_steps}"
        )
    return text
