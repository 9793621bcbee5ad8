"""The training loop: data -> features -> head (+ backbone) -> loss -> validation -> run directory.

One loop for both modes (:mod:`training.workloads`), single process or ``torchrun`` DDP. Every epoch (or
``eval_every`` steps) the model is evaluated on the validation classes; the best step's weights are kept
in ``checkpoints/best.pt``, starting with the untrained model (step 0: the PCA-initialised head), so the
selected model is never worse on validation than its starting point. The honest baseline is the backbone's
own pooled features, without any head: their validation metrics are recorded at step 0 (``val_backbone``)
and the summary says whether the selected model is *better* than them (``beats_backbone``): the paired
bootstrap interval on the validation Recall@1 difference (``validation_gain``) lies above zero.
``checkpoints/last.pt`` holds everything needed to continue after an interruption (weights, optimiser,
sampler and generator states); a stop signal (``foundation.stopping``) saves it after the current step and
ends the run there. At the end the best model is evaluated on the unseen test classes into
``summary.json``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engine.duplicates.tiers import Tier
from foundation import stopping
from foundation.progress import progress_bar
from training.backbone import BACKBONES
from training.bootstrap import Interval, paired_bootstrap
from training.config import TrainConfig
from training.copies import copy_groups, signatures
from training.data import LOOSE, DataError, LabelledImages, load_labelled_images, split_classes
from training.distributed import Distributed, distributed_from_env
from training.features import Augmentation, FeatureExtractor
from training.feedback_advice import judge_more
from training.feedback_data import HELD_OUT_SHARE, load_feedback
from training.feedback_gate import FeedbackGate, feedback_gate, unjudged_check
from training.feedback_rows import JUDGED_SPLIT, UNJUDGED_SPLIT, JudgedRows, judged_only, with_judged_photos
from training.feedback_sampler import FeedbackSampler
from training.label_free_data import (
    EVAL_AUGMENTATION,
    EVAL_VIEW,
    GATE_AUGMENTATION,
    NEIGHBOURS,
    LabelFreePlan,
    label_free_images,
    plan_label_free,
)
from training.losses import LOSSES, LossSpec
from training.metrics import evaluate, neighbourhood_agreement, top_hits
from training.model import build_objective
from training.precision import Compute, resolve_compute
from training.pseudo_labels import FINETUNE_REFRESH_EPOCHS, PseudoLabelSampler
from training.run_dir import (
    LABEL_FREE_SCORE,
    BestCheckpoint,
    FrozenStageSummary,
    LabelFreeRecord,
    LastCheckpoint,
    NeighbourhoodCheck,
    PseudoLabelRefresh,
    RunDirectory,
    RunDirError,
    RunSummary,
    TrainState,
)
from training.samplers import ClassBalancedSampler, sampler_for
from training.workloads import CachedWorkload, FinetuneWorkload, SeededViews

SELECTION_METRIC = "recall@1"
# A run whose loss is stuck learns nothing: 0 (every example already meets the loss's margin, so there is
# no gradient), the same value step after step, or not finite. Judged over the last STUCK_WINDOW steps
# (or, at the end, over a run's STUCK_MIN_STEPS or more): stuck when the loss moved at no more than
# STUCK_MOVING_SHARE of them (at least one step allowed: a first batch may still have something to learn).
STUCK_WINDOW = 50
STUCK_MIN_STEPS = 5
STUCK_MOVING_SHARE = 0.05
# A loss at 0 on most steps, but not enough to call the run stuck: the other steps still learn, so the run
# is judged by validation as usual, and the user is told that most of its steps taught nothing.
MOSTLY_ZERO_SHARE = 0.5
FROZEN_STAGE = "frozen-stage"  # the run directory, inside a fine-tuning run's, of its frozen first stage
GATE_SPLIT = "val_strong"  # a label-free run's validation photos as their strong view: the gate's 2nd check


@dataclass(frozen=True)
class PreparedData:
    """The readable images of each split, their labels and cached backbone outputs.

    A label-free run (``label_free``) holds out photos, not classes: each held-out photo is two rows of its
    split, as served and as an augmented view, labelled with its id (:mod:`training.label_free_data`); its
    training labels are real or LOOSE, which the pseudo-labelling sampler replaces. A run on judgments
    (``judged``, :mod:`training.feedback_rows`) has training rows past ``labels("train")``: judged photos.
    """

    images: LabelledImages
    indices: dict[str, np.ndarray]  # split -> image index of each row
    row_labels: dict[str, np.ndarray]  # split -> label of each row
    features: dict[str, np.ndarray]  # split -> pooled pretrained features, serving view (PCA, baseline)
    inputs: dict[str, np.ndarray]  # split -> model input: `features` (frozen) or trunk maps (partial)
    train_views: np.ndarray  # (1 + augmented views, n_train, *input shape): inputs of training
    label_free: LabelFreePlan | None = None
    judged: JudgedRows | None = None  # a run with --feedback: its judged photos' rows (feedback_rows)
    # label-free: per held-out split, the rows shown as an augmented view (fine-tuning makes them anew)
    held_out_views: dict[str, SeededViews] = field(default_factory=dict)
    gate_views: SeededViews | None = None  # label-free: GATE_SPLIT's rows, each a strong view

    def labels(self, split: str) -> np.ndarray:
        return self.row_labels[split]

    def files(self, split: str) -> list[Path]:
        return self.images.files(self.indices[split])

    @property
    def class_names(self) -> tuple[str, ...]:
        """The name of each label of the validation and test rows: a class, or a held-out photo's path."""
        return self.images.paths if self.label_free is not None else self.images.class_names

    def seeded_views(self, names: Sequence[str]) -> SeededViews | None:
        """The rows of the splits ``names``, in order, that a fine-tuning workload shows as augmented views
        (a label-free run's held-out views); None for a labelled run."""
        if not self.held_out_views:
            return None
        held_out = self.held_out_views
        positions = [
            held_out[name].positions if name in held_out else np.full(len(self.indices[name]), -1)
            for name in names
        ]
        return replace(next(iter(held_out.values())), positions=np.concatenate(positions))

    def train_copies(self) -> np.ndarray:
        """Per training row, the training row of its first byte copy (itself when it has none)."""
        assert self.label_free is not None
        train = self.indices["train"]
        first = {int(image): row for row, image in reversed(list(enumerate(train)))}
        return np.array(
            [first.get(int(self.label_free.copies[image]), row) for row, image in enumerate(train)]
        )


def cache_directory(config: TrainConfig, run_dir: Path) -> Path:
    return Path(config.cache_dir) if config.cache_dir else run_dir / "cache"


def prepare_data(
    config: TrainConfig, cache_dir: Path, dist: Distributed | None = None, *, progress: bool = True
) -> PreparedData:
    """Load and split the images, extract (or read cached) backbone outputs, drop unreadable images; with
    ``feedback``, the judged photos too (:mod:`training.feedback_rows`), beside the folder's or alone.

    Frozen mode feeds the head pooled features; partial mode feeds the backbone's last stage the maps
    entering it. Either way the pooled features are prepared too (PCA initialisation, baseline metrics).
    """
    if config.feedback is None:
        return _folder_data(config, cache_dir, dist, progress)
    if config.mode == "partial":
        raise DataError("a run on judgments (--feedback) trains in --mode frozen or finetune, not partial")
    feedback = load_feedback(Path(config.feedback), seed=config.seed, validation=config.data is None)
    if config.data is None:
        return PreparedData(**vars(judged_only(config, feedback, cache_dir, progress)))
    return with_judged_photos(
        _folder_data(config, cache_dir, dist, progress), config, feedback, cache_dir, progress
    )


def _folder_data(
    config: TrainConfig, cache_dir: Path, dist: Distributed | None, progress: bool
) -> PreparedData:
    """The data folder's images, split and with their backbone outputs (:func:`prepare_data`)."""
    assert config.data is not None
    dist = dist or Distributed()
    loose = label_free_images(Path(config.data), config.labels)
    plan = None if loose is None else _label_free_plan(config, loose, cache_dir, dist, progress)
    if plan is not None:
        images, pool = plan.images, np.arange(len(plan.images))
        split: dict[str, np.ndarray] = {"train": plan.train, "val": plan.val, "test": plan.test}
    else:
        images = load_labelled_images(Path(config.data))
        classes = split_classes(
            images,
            train_classes=config.train_classes,
            val_fraction=config.val_fraction,
            fold=config.fold,
            folds=config.folds,
        )
        pool = classes.pool
        split = {name: classes[name] for name in ("train", "val", "test")}
    for turn in (True, False):  # the main process extracts first; the others then read the cache
        if dist.is_main == turn:
            show = progress and dist.is_main
            pooled = FeatureExtractor(cache_dir, config.backbone, progress=show)
            base = pooled.extract(images.files())
            extractor = pooled
            if config.mode == "partial":
                extractor = FeatureExtractor(cache_dir, config.backbone, stage="trunk", progress=show)
            base_inputs = base.features if extractor is pooled else extractor.extract(images.files()).features
            # Augmented views are extracted for the readable images of the whole training pool, so the
            # cache stays valid when the validation share or the cross-validation fold changes.
            training_range = pool[base.ok[pool]]
            seed = config.effective_view_seed
            augmented = [
                extractor.extract(images.files(training_range), view=view, seed=seed).features
                for view in range(1, config.views + 1)
            ]
            held_out_view = gate_view = None
            if plan is not None:
                held = np.sort(np.concatenate([plan.val, plan.test]))
                held_out_view = held_out_views_of(
                    held[base.ok[held]], images, pooled, extractor, seed, EVAL_AUGMENTATION
                )
                val = plan.val[base.ok[plan.val]]
                gate_view = held_out_views_of(val, images, pooled, extractor, seed, GATE_AUGMENTATION)
        dist.barrier()
    indices = {name: split[name][base.ok[split[name]]] for name in ("train", "val", "test")}
    row_labels = {name: images.labels[kept] for name, kept in indices.items()}
    if plan is None:
        for name, kept in indices.items():
            if len(np.unique(images.labels[kept])) < 2:
                raise DataError(f"the {name} split has fewer than two classes of readable images")
    rows = np.searchsorted(training_range, indices["train"])
    train_views = np.stack([base_inputs[indices["train"]], *(inputs[rows] for inputs in augmented)])
    features = {name: base.features[kept] for name, kept in indices.items()}
    # Frozen mode feeds the pooled features themselves: share them rather than copy every split again.
    inputs = (
        features
        if base_inputs is base.features
        else {name: base_inputs[kept] for name, kept in indices.items()}
    )
    held_out_views: dict[str, SeededViews] = {}
    gate_views = None
    if plan is not None:
        assert held_out_view is not None and gate_view is not None
        inputs, features = dict(inputs), dict(features)
        indices[GATE_SPLIT] = gate_view.photos  # the readable validation photos, in their split's order
        row_labels[GATE_SPLIT] = plan.held_out_labels(gate_view.photos)
        features[GATE_SPLIT], inputs[GATE_SPLIT] = gate_view.pooled, gate_view.inputs
        gate_views = SeededViews(np.arange(len(gate_view.photos)), EVAL_VIEW, seed, GATE_AUGMENTATION)
        for name in ("val", "test"):
            held, at = indices[name], np.searchsorted(held_out_view.photos, indices[name])
            positions = np.concatenate([np.full(len(held), -1), at])
            held_out_views[name] = SeededViews(positions, EVAL_VIEW, seed, EVAL_AUGMENTATION)
            indices[name] = np.concatenate([held, held])
            row_labels[name] = np.concatenate([plan.held_out_labels(held)] * 2)
            features[name] = np.concatenate([features[name], held_out_view.pooled[at]])
            inputs[name] = np.concatenate([inputs[name], held_out_view.inputs[at]])
        if config.mode == "frozen":
            inputs = features
    return PreparedData(
        images=images,
        indices=indices,
        row_labels=row_labels,
        features=features,
        inputs=inputs,
        train_views=train_views,
        label_free=plan,
        held_out_views=held_out_views,
        gate_views=gate_views,
    )


def _label_free_plan(
    config: TrainConfig, images: LabelledImages, cache_dir: Path, dist: Distributed, progress: bool
) -> LabelFreePlan:
    """The label-free split (:func:`plan_label_free`), with byte and edited copies (:mod:`training.copies`)
    found from the untrained backbone's pooled features, which the run then reads from the cache."""
    for turn in (True, False):  # the main process extracts first; the others then read the cache
        if dist.is_main == turn:
            show = progress and dist.is_main
            extractor = FeatureExtractor(cache_dir, config.backbone, progress=show)
            pooled = extractor.extract(images.files())
            draft = extractor.embedder.card.preprocessing.resize_size
            signed = signatures(images.files(), cache_dir, draft, progress=show)
        dist.barrier()
    tier = Tier.parse(config.copies)
    copies = copy_groups(images.files(), pooled.features, pooled.ok, signed, tier)
    return plan_label_free(images, seed=config.seed, copies=copies)


@dataclass(frozen=True)
class HeldOutView:
    """An augmented view of a label-free run's held-out photos: the crop view its check finds them again
    from, or the strong view of the validation photos that the gate's neighbourhood check embeds."""

    photos: np.ndarray  # the readable held-out photos (image indices, sorted): the list the view was made of
    pooled: np.ndarray  # the untrained backbone's pooled features of the view (the baseline)
    inputs: np.ndarray  # the model's inputs of the view (pooled features, or trunk maps in partial mode)


def held_out_views_of(
    photos: np.ndarray,
    images: LabelledImages,
    pooled: FeatureExtractor,
    extractor: FeatureExtractor,
    seed: int,
    augmentation: Augmentation,
) -> HeldOutView:
    """View :data:`EVAL_VIEW` (made by ``augmentation``) of each of the readable held-out ``photos``."""
    files = images.files(photos)
    view = pooled.extract(files, view=EVAL_VIEW, seed=seed, augmentation=augmentation).features
    inputs = view
    if extractor is not pooled:
        inputs = extractor.extract(files, view=EVAL_VIEW, seed=seed, augmentation=augmentation).features
    return HeldOutView(photos, view, inputs)


@dataclass
class LossWatch:
    """The last :data:`STUCK_WINDOW` training losses, to tell a run that is learning nothing."""

    loss: str
    when_zero: str = ""  # the loss's own explanation of a zero loss (LossSpec.when_zero)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=STUCK_WINDOW))

    def add(self, value: float) -> None:
        self.recent.append(value)

    def stuck(self, *, final: bool = False) -> str | None:
        """Why the loss is stuck, in plain words, or None: over a full window, or ``final``ly over what
        there is (a run that stopped before the window filled)."""
        values = np.asarray(self.recent, dtype=np.float64)
        if len(values) < (STUCK_MIN_STEPS if final else STUCK_WINDOW):
            return None
        least = len(values) - max(1, int(STUCK_MOVING_SHARE * len(values)))  # steps that must be stuck
        finite = np.isfinite(values)
        last = f"of the last {len(values)} steps"
        if (~finite).sum() >= least:
            return (
                f"the {self.loss} loss was not finite at {(~finite).sum()} {last}: training diverged "
                "(a lower learning rate, -p lr=..., may help)"
            )
        if (values[finite] == 0).sum() >= least:
            why = f": {self.when_zero}" if self.when_zero else ": every batch already met its margin"
            zero = int((values[finite] == 0).sum())
            return f"the {self.loss} loss was 0 at {zero} {last}, so nothing was learned{why}"
        scale = max(1.0, float(np.abs(values[finite]).max()))
        still = int((np.abs(np.diff(values[finite])) <= 1e-6 * scale).sum())
        if still >= least - 1:  # n values hold n - 1 changes
            return f"the {self.loss} loss stayed at {values[finite][-1]:.4g} through {still + 1} {last}"
        return None


def mostly_zero_loss(loss: str, records: Sequence[dict[str, Any]]) -> str | None:
    """Plain words when the loss was 0 through :data:`MOSTLY_ZERO_SHARE` or more of a run's steps, else None.

    ``records`` are metrics.jsonl's, each with the mean loss of the steps since the one before; the losses
    are never negative, so a mean of 0 means every one of those steps was 0 (a lower bound where not)."""
    zero = total = previous = 0
    for record in records:
        steps, previous = record["step"] - previous, record["step"]
        if record.get("train_loss") is None:
            continue
        total += steps
        zero += steps if record["train_loss"] == 0 else 0
    if total == 0 or zero < MOSTLY_ZERO_SHARE * total:
        return None
    why = LOSSES[loss].when_zero if loss in LOSSES else ""
    return (
        f"the {loss} loss was 0 through {zero} of its {total} steps, which taught nothing: "
        f"{why or 'every batch already met its margin'}"
    )


@dataclass(frozen=True)
class ValidationGain:
    """The selected checkpoint against the untrained backbone's raw features on the validation classes:
    the Recall@1 of each and the paired bootstrap interval on their difference (queries resampled).

    A run improved on the backbone only if a trained step is *better* by that interval (all of it above
    zero), not merely higher: on Cars196's class folds, nearly every run whose test Recall@1 ended below the
    untrained model's had a validation gain inside the interval (bench/results/recipes_cv*.md), so a gain
    validation cannot tell from noise is not served.
    """

    untrained: float
    trained: float
    best_step: int
    interval: Interval

    @property
    def improved(self) -> bool:
        return self.best_step > 0 and self.interval.verdict == "better"

    def describe(self) -> str:
        interval = self.interval
        return (
            f"validation recall@1 {100 * self.trained:.2f} at step {self.best_step} vs "
            f"{100 * self.untrained:.2f} untrained, difference {100 * interval.difference:+.2f} "
            f"({100 * interval.level:.0f}% CI [{100 * interval.low:+.2f}, {100 * interval.high:+.2f}]): "
            f"{interval.verdict}"
        )


class NoGainWarning(UserWarning):
    """The selected model did not beat the untrained backbone on validation (``dmlsearch export`` refuses
    it). A category of its own, so callers that report this themselves (the CLI, the auto race) can
    silence it."""


def run_compute(config: TrainConfig, device: torch.device) -> Compute:
    """How the run computes: partial and finetune train a backbone, in the configured precision and
    memory format; frozen trains the head alone on cached features, in float32 (there is nothing to win)."""
    if config.mode == "frozen":
        return Compute(device, None, False, "frozen: the head alone trains, in float32")
    return resolve_compute(config.precision, config.channels_last, device)


@dataclass(frozen=True)
class FrozenStage:
    """What a fine-tuning run starts from after its frozen first stage: the stage's best weights and
    summary."""

    weights: dict[str, torch.Tensor]
    summary: RunSummary


def frozen_stage(config: TrainConfig, out: Path, *, progress: bool) -> FrozenStage:
    """The first stage of a ``frozen_first`` fine-tuning run: the head (and the loss's own parameters)
    trained on cached features in frozen mode, in ``out/frozen-stage``, with the frozen mode's step budget.

    Fine-tuning from a head that already fits the pretrained features changes those features less than
    fine-tuning from an untrained head (LP-FT: Kumar et al. 2022, "Fine-Tuning can Distort Pretrained
    Features"), and costs the frozen mode's minutes; the fine-tuning run then validates from its result.
    Returns the stage's best weights and summary.
    """
    defaults = TrainConfig.model_fields
    stage = config.model_copy(
        update={
            "mode": "frozen",
            "frozen_first": False,
            "max_steps": defaults["max_steps"].default,
            "time_budget": None,
            "compute": None,
            "cache_dir": str(cache_directory(config, out)),  # the backbone features are extracted once
        }
    )
    path = out / FROZEN_STAGE
    summary = train(stage, path, progress=progress)
    best = RunDirectory(path).load_best()
    if best is None:
        raise RunDirError(f"{path} finished without checkpoints/best.pt: remove it and run again")
    return FrozenStage(best.objective, summary)


def train(config: TrainConfig, out: Path, *, progress: bool = True) -> RunSummary:
    """Train (or continue training) the run in ``out``; returns its summary (also in summary.json)."""
    spec = LOSSES[config.loss]  # an unknown loss fails here, before the run directory is touched
    if config.feedback is not None and not spec.judged_pairs:
        judged = sorted(name for name, entry in LOSSES.items() if entry.judged_pairs)
        raise DataError(f"{config.loss} does not train on judged pairs; with --feedback use one of {judged}")
    run = RunDirectory(out)
    first: FrozenStage | None = None
    if config.mode == "finetune" and config.frozen_first and run.load_last() is None:
        first = frozen_stage(config, out, progress=progress)
    with distributed_from_env(config.device) as dist:
        device = dist.device(config.device)  # a missing GPU fails before any work
        last = run.load_last()
        if last is not None and (conflicts := config.resume_conflicts(run.require_config())):
            raise RunDirError(
                f"{run.path} holds a run with a different {', '.join(conflicts)}; use a new --out directory"
            )
        summary = run.read_summary()
        finished = last is not None and (last.progress.stopped or last.progress.step >= config.max_steps)
        if finished and summary is not None:
            return summary
        compute = run_compute(config, device)  # precision=fp16 on a CPU fails here, before any work
        config = config.model_copy(update={"compute": compute.record()})
        if dist.is_main:
            run.write_config(config)
        progress = progress and dist.is_main
        data = prepare_data(config, cache_directory(config, run.path), dist, progress=progress)
        training = _Training(config, spec, run, dist, compute, data, progress=progress)
        if first is not None:
            training.start_from(first)
        return training.run(last)


def finetune_inputs(data: PreparedData) -> tuple[dict[str, list[Path]], dict[str, SeededViews]]:
    """What a fine-tuning run embeds: the photo of each row of each split, in the rows' order, and the
    splits with rows shown as a seeded augmented view (the label-free checks', the unjudged sample's)."""
    splits = ("train", "val", "test", GATE_SPLIT)
    files = {name: data.files(name) for name in splits if name in data.indices}
    views = dict(data.held_out_views)
    if data.gate_views is not None:
        views[GATE_SPLIT] = data.gate_views
    if (judged := data.judged) is not None:  # judged photos past the folder's, and the gate's splits
        files["train"] = files["train"][: judged.data_rows] + judged.photos("train")
        files.update({name: judged.photos(name) for name in (JUDGED_SPLIT, UNJUDGED_SPLIT)})
        views[UNJUDGED_SPLIT] = judged.unjudged.views
    return files, views


class _Training:
    """One run's components, built from its prepared data; :meth:`run` restores them from ``last.pt`` or
    initialises them, wraps the objective for DDP, trains and writes the summary."""

    def __init__(
        self,
        config: TrainConfig,
        spec: LossSpec,
        run: RunDirectory,
        dist: Distributed,
        compute: Compute,
        data: PreparedData,
        *,
        progress: bool,
    ) -> None:
        self.config = config
        self.spec = spec
        self.run_dir = run
        self.dist = dist
        self.compute = compute
        self.device = compute.device
        self.data = data
        self.progress = progress
        if data.label_free is not None and config.views < 1:  # a photo's two copies in a batch would be one
            raise DataError("a run without labels needs augmented views of its photos: -p views=N, N >= 1")
        self.objective = build_objective(config, data.features["train"].shape[1])
        self.objective.head.init_from_pca(data.features["train"], seed=config.seed)
        compute.prepare_module(self.objective.to(self.device))
        self.workload = self._workload()
        self.sampler = self._sampler(seed=config.seed * 1000 + dist.rank)  # each rank its own batches
        self.view_rng = np.random.default_rng([config.seed, dist.rank])
        self.optimizer = torch.optim.Adam(self._param_groups(), weight_decay=config.weight_decay)
        self.scaler = torch.amp.GradScaler("cuda", enabled=compute.autocast == torch.float16)
        self.state = TrainState()
        self.records: list[dict[str, Any]] = []  # one per validation, as in metrics.jsonl
        self.best: BestCheckpoint | None = None
        self.first_stage: FrozenStageSummary | None = None  # frozen_first: what the frozen stage reached
        self.watch = LossWatch(config.loss, spec.when_zero)  # this session's steps

    def _sampler(self, seed: int) -> ClassBalancedSampler:
        """The loss's layout's sampler; in a label-free run, over pseudo-labels that it refreshes; with
        judgments, with judged pairs added to its batches (alone: the judged pairs only)."""
        judged = self.data.judged
        if judged is None:
            return self._folder_sampler(seed)
        inner = self._folder_sampler(seed) if judged.data_rows else None
        return FeedbackSampler(inner, judged.row_items, judged.feedback.train, seed=seed)

    def _folder_sampler(self, seed: int) -> ClassBalancedSampler:
        config, layout = self.config, self.spec.layout
        if self.data.label_free is not None:
            return PseudoLabelSampler(
                layout,
                self.data.labels("train"),
                self.data.train_copies(),
                classes=config.classes_per_batch,
                samples_per_class=config.samples_per_class,
                clusters_per_class=config.clusters_per_class,
                refresh_epochs=FINETUNE_REFRESH_EPOCHS if config.mode == "finetune" else 0.0,
                seed=seed,
            )
        return sampler_for(
            layout,
            self.data.labels("train"),
            classes=config.classes_per_batch,
            samples_per_class=config.samples_per_class,
            clusters_per_class=config.clusters_per_class,
            refresh_interval=config.cluster_refresh,
            seed=seed,
        )

    def start_from(self, stage: FrozenStage) -> None:
        """Start from a frozen stage's head and loss parameters instead of the PCA-initialised head."""
        missing, unexpected = self.objective.load_state_dict(stage.weights, strict=False)
        if unexpected or any(not key.startswith("backbone.") for key in missing):
            raise RunDirError(f"the frozen stage's weights do not fit this run: {unexpected or missing}")
        reached = stage.summary.model_dump(include=set(FrozenStageSummary.model_fields))
        self.first_stage = FrozenStageSummary.model_validate(reached)

    def run(self, last: LastCheckpoint | None) -> RunSummary:
        if last is not None:
            self._restore(last)
        else:
            self._initialise()
        self._loop(self._wrap_for_ddp())
        return self._finish()

    def _restore(self, last: LastCheckpoint) -> None:
        """Continue from ``last.pt``: every component's state, the progress, the metrics and best.pt."""
        self.objective.load_state_dict(last.objective)
        self.optimizer.load_state_dict(last.optimizer)
        self.sampler.load_state_dict(last.sampler)
        self.view_rng.bit_generator.state = last.view_rng
        self.scaler.load_state_dict(last.scaler)
        self.state = replace(last.progress)  # the loop advances its own copy
        self.records = [record for record in self.run_dir.read_metrics() if record["step"] <= self.state.step]
        self.best = self.run_dir.load_best()
        if self.best is None:
            raise RunDirError(f"{self.run_dir.path} has checkpoints/last.pt but no best.pt: start a new run")
        if self.progress:
            print(
                f"resuming from step {self.state.step} of {self.config.max_steps} "
                f"({self.run_dir.path / 'checkpoints' / 'last.pt'})",
                flush=True,
            )

    def _initialise(self) -> None:
        """Start a run: validate the starting model (step 0, the first best) and save it."""
        self.records.append(self._validate(step=0, train_loss=None))
        self.records[-1]["val_backbone"] = self._backbone_metrics("val")
        if self.first_stage is not None:
            self.records[-1]["frozen_stage"] = self.first_stage.model_dump()
        self._save()

    def _backbone_metrics(self, split: str) -> dict[str, float]:
        """The untrained backbone's own pooled features on ``split``, without any head: the baseline."""
        return evaluate(self.data.features[split], self.data.labels(split), seed=self.config.seed)

    def _wrap_for_ddp(self) -> nn.Module:
        """The module the loop calls: the objective, or under torchrun its DistributedDataParallel."""
        if not self.dist.enabled:
            return self.objective
        # Buffers stay per rank: ALMN's centre table grows with the labels each rank sees.
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(self.objective, device_ids=device_ids, broadcast_buffers=False)

    def _workload(self) -> CachedWorkload | FinetuneWorkload:
        data = self.data
        if self.config.mode != "finetune":
            eval_inputs = {
                name: data.inputs[name]
                for name in ("val", "test", JUDGED_SPLIT, UNJUDGED_SPLIT, GATE_SPLIT)
                if name in data.inputs
            }
            return CachedWorkload(
                self.objective,
                data.train_views,
                eval_inputs,
                self.device,
                channels_last=self.compute.channels_last,
            )
        files, views = finetune_inputs(data)
        preprocessing = BACKBONES[self.config.backbone].preprocessing
        return FinetuneWorkload(
            self.objective,
            files,
            preprocessing,
            self.device,
            workers=self.config.workers,
            batch_size=self.config.eval_batch_size,
            channels_last=self.compute.channels_last,
            train_size=self.config.train_size,
            min_crop_area=self.config.min_crop_area,
            views=views,
        )

    def _param_groups(self) -> list[dict[str, Any]]:
        """The new layers at ``lr``; a fine-tuned backbone at ``lr x backbone_lr_factor`` (papers: 1/10)."""
        objective = self.objective
        groups = [
            {"params": [*objective.head.parameters(), *objective.loss.parameters()], "lr": self.config.lr}
        ]
        backbone = list(objective.backbone.parameters())
        if backbone:
            groups.append({"params": backbone, "lr": self.config.lr * self.config.backbone_lr_factor})
        return groups

    def _loop(self, model: nn.Module) -> None:
        config, state, sampler = self.config, self.state, self.sampler
        eval_every = config.eval_every or max(
            1, math.ceil(len(self.data.labels("train")) / sampler.batch_size)
        )
        batches = self.workload.batches(sampler, self.view_rng)
        bar = progress_bar(
            initial=state.step,
            total=config.max_steps,
            desc=f"training {config.loss}",
            unit="step",
            disable=not self.progress,
        )
        self.objective.train()
        losses: list[float] = []
        started = time.perf_counter()
        images, step_seconds = 0, 0.0  # this session's training steps, validation excluded: img/s
        while state.step < config.max_steps and not state.stopped:
            step_started = time.perf_counter()
            if sampler.refresh_due(state.step):
                sampler.refresh(self.workload.embed("train"))
            indices, inputs = next(batches)
            batch_info = {key: value.to(self.device) for key, value in sampler.batch_info(indices).items()}
            with self.compute.autocast_context():
                labels = torch.as_tensor(sampler.labels[indices]).to(self.device)  # pseudo-labels change
                value = model(inputs, labels, **batch_info)
            self.optimizer.zero_grad(set_to_none=True)
            if self.dist.all_true(bool(torch.isfinite(value))):  # ranks skip a step together or not at all
                self.scaler.scale(value).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                losses.append(float(value.detach()))
            self.watch.add(float(value.detach()))
            # A stuck loss ends the run (validated at this step, as at the time budget): after a first
            # validated gain there is nothing more to learn; before one, the run failed (_finish says why).
            stuck = not self.dist.all_true(self.watch.stuck() is None)
            sampler.after_step(indices, self.objective.loss)
            state.step += 1
            images, step_seconds = images + len(indices), step_seconds + time.perf_counter() - step_started
            bar.set_postfix_str(f"{images / step_seconds:.1f} img/s", refresh=False)
            bar.update()
            # The time budget counts training steps (as train_seconds does): past it, the run validates
            # this step and stops, keeping the best validated checkpoint.
            out_of_time = config.time_budget is not None and (
                state.elapsed + time.perf_counter() - started >= config.time_budget
            )
            if state.step % eval_every == 0 or state.step == config.max_steps or out_of_time or stuck:
                state.elapsed += time.perf_counter() - started
                started = time.perf_counter()
                train_loss = float(np.mean(losses)) if losses else None
                self.records.append(self._validate(state.step, train_loss))
                losses = []
                state.stopped = state.stopped or out_of_time or stuck
                bar.set_postfix(
                    loss=train_loss,
                    val_r1=self.records[-1]["val"][SELECTION_METRIC],
                    img_s=images / step_seconds,
                )
                self._save()
            # Ranks stop together (one collective per step under DDP), after saving last.pt: a rerun resumes.
            if not self.dist.all_true(not stopping.requested().is_set()):
                state.elapsed += time.perf_counter() - started
                self._save()
                bar.close()
                stopping.stop_now()
        bar.close()

    def _label_free_record(self, neighbours: NeighbourhoodCheck | None) -> LabelFreeRecord | None:
        """What a label-free run's summary says about its photos, pseudo-labels and gate."""
        plan = self.data.label_free
        sampler = self.sampler.inner if isinstance(self.sampler, FeedbackSampler) else self.sampler
        if plan is None or not isinstance(sampler, PseudoLabelSampler):
            return None
        train = self.data.labels("train")
        return LabelFreeRecord(
            labelled_photos=int((train != LOOSE).sum()),
            loose_photos=int((train == LOOSE).sum()),
            held_out_photos={name: len(self.data.indices[name]) // 2 for name in ("val", "test")},
            copies_merged=int(len(plan.copies) - len(np.unique(plan.copies))),
            score=LABEL_FREE_SCORE,
            refreshes=[PseudoLabelRefresh(**entry) for entry in sampler.history],
            neighbours=neighbours,
        )

    def _neighbourhood_check(self, val: np.ndarray) -> NeighbourhoodCheck:
        """The label-free gate's second check (:mod:`training.label_free_data`), the selected model against
        the untrained backbone: each validation photo's neighbours among the folder's photos as served
        (training and validation photos), and its strong view's. ``val``: the selected model's embedding of
        the validation rows, whose served half is reused; the check embeds the training photos once more
        (in fine-tuning, as a pseudo-label refresh does) and the strong views."""
        started = time.perf_counter()
        data, workload = self.data, self.workload
        photos = len(data.indices[GATE_SPLIT])  # the served half of the validation rows, in that order
        held = len(data.features["train"]) + np.arange(photos)

        def agreement(train: np.ndarray, served: np.ndarray, views: np.ndarray) -> np.ndarray:
            return neighbourhood_agreement(np.concatenate([train, served[:photos]]), held, views, NEIGHBOURS)

        trained = agreement(workload.embed("train"), val, workload.embed(GATE_SPLIT))
        untrained = agreement(data.features["train"], data.features["val"], data.features[GATE_SPLIT])
        return NeighbourhoodCheck(
            neighbours=NEIGHBOURS,
            untrained=float(untrained.mean()),
            trained=float(trained.mean()),
            interval=paired_bootstrap(trained, untrained, seed=self.config.seed),
            seconds=round(time.perf_counter() - started, 1),
        )

    def _feedback_gate(self) -> FeedbackGate | None:
        """The held-out judgments scored by the served vectors and by the selected model (feedback_gate)."""
        judged = self.data.judged
        if judged is None:
            return None
        feedback, sample = judged.feedback, judged.unjudged
        unjudged = None
        if len(sample.items) > 1:
            after = self.workload.embed(UNJUDGED_SPLIT)
            unjudged = unjudged_check(
                sample.items, sample.before, after, baseline=sample.baseline, seed=self.config.seed
            )
        return feedback_gate(
            index=str(feedback.index),
            trained=len(feedback.train),
            validation=len(feedback.val),
            held_out=feedback.test,
            uploads=feedback.uploads,
            before=feedback.served,
            after=dict(zip(judged.held_out, self.workload.embed(JUDGED_SPLIT), strict=True)),
            unjudged=unjudged,
            seed=self.config.seed,
        )

    def _judge_more(self, gate: FeedbackGate) -> str:
        """What to judge next, from the judgments the run trained on and its gate (feedback_advice)."""
        assert self.data.judged is not None
        feedback = self.data.judged.feedback
        return judge_more(
            feedback.train,
            feedback.served,
            interval=gate.interval,
            held_out_queries=gate.queries_held_out,
            held_out_share=HELD_OUT_SHARE,
            moved_queries=gate.queries_moved,
        )

    def _validate(self, step: int, train_loss: float | None) -> dict[str, Any]:
        """Evaluate on the validation classes; keep the weights in best.pt when they are the best so far."""
        state = self.state
        metrics = evaluate(self.workload.embed("val"), self.data.labels("val"), seed=self.config.seed)
        score = metrics[SELECTION_METRIC]
        if score > state.best_score:
            state.best_step, state.best_score, state.since_best = step, score, 0
            # Every rank keeps its own copy: ranks take the same decisions and need not share a disk.
            weights = {
                key: value.detach().cpu().clone() for key, value in self.objective.state_dict().items()
            }
            self.best = BestCheckpoint(objective=weights, step=step, val=metrics)
            if self.dist.is_main:
                self.run_dir.save_best(self.best)
        elif step > 0:
            state.since_best += 1
            out_of_patience = state.since_best >= self.config.patience
            state.stopped = out_of_patience and step >= self.config.min_steps
        return {"step": step, "train_loss": train_loss, "val": metrics, "best_step": state.best_step}

    def _save(self) -> None:
        """``last.pt`` (progress and every component's state) and ``metrics.jsonl``, from the main rank."""
        if not self.dist.is_main:
            return
        checkpoint = LastCheckpoint(
            progress=replace(self.state),
            objective=self.objective.state_dict(),
            optimizer=self.optimizer.state_dict(),
            sampler=self.sampler.state_dict(),
            view_rng=self.view_rng.bit_generator.state,
            scaler=self.scaler.state_dict(),
        )
        self.run_dir.save_last(checkpoint)
        self.run_dir.write_metrics(self.records)

    def _finish(self) -> RunSummary:
        """Evaluate the best weights on the unseen test classes and write summary.json."""
        best, state = self.best, self.state
        assert best is not None  # _initialise or _restore set it
        self.objective.load_state_dict(best.objective)
        seed = self.config.seed
        # A run started before the baseline was recorded at step 0 gets it now.
        val_backbone = self.records[0].get("val_backbone") or self._backbone_metrics("val")
        labels = self.data.labels("val")
        val = self.workload.embed("val")
        interval = paired_bootstrap(
            top_hits(val, labels).hit, top_hits(self.data.features["val"], labels).hit, seed=seed
        )
        gain = ValidationGain(val_backbone[SELECTION_METRIC], best.val[SELECTION_METRIC], best.step, interval)
        # Without labels the gate asks a second check to agree on the same checkpoint (label_free_data);
        # where the first already refuses, the extra pass is not spent.
        label_free = self.data.label_free is not None
        neighbours = self._neighbourhood_check(val) if label_free and gain.improved else None
        served = gain.improved and (not label_free or (neighbours is not None and neighbours.passed))
        first_stage = self.records[0].get("frozen_stage")
        # Failed: no validated gain and a stuck loss; the summary, the CLI, the report and the Model page
        # then say that the run learned nothing and why, rather than compare its step-0 head.
        failure = self.watch.stuck(final=True) if best.step == 0 else None
        feedback = self._feedback_gate()
        if feedback is not None and (failure is not None or not feedback.judgments_better):
            advice = self._judge_more(feedback)
            feedback = feedback.model_copy(update={"judge_more": advice})
            failure = None if failure is None else f"{failure}; {advice}"
        summary = RunSummary(
            loss=self.config.loss,
            mode=self.config.mode,
            steps=state.step,
            stopped_early=state.stopped,
            best_step=best.step,
            train_seconds=round(state.elapsed, 1),
            val=best.val,
            val_backbone=val_backbone,
            beats_backbone=served,
            validation_gain=interval,
            test=evaluate(self.workload.embed("test"), self.data.labels("test"), seed=seed),
            test_backbone=self._backbone_metrics("test"),
            skipped_images=int(
                len(self.data.images) - len(np.unique(np.concatenate(list(self.data.indices.values()))))
            ),
            frozen_stage=FrozenStageSummary.model_validate(first_stage) if first_stage else None,
            failure=failure,
            label_free=self._label_free_record(neighbours),
            feedback=feedback,
        )
        if self.dist.is_main:
            self.run_dir.write_summary(summary)
        if summary.feedback is not None and not summary.feedback.passed:
            warnings.warn(
                f"{self.config.loss}: not better on the held-out judgments ({summary.feedback.describe()}); "
                "export refuses it, keep serving the model the index has",
                NoGainWarning,
                stacklevel=2,
            )
        if not served and failure is None and self.config.data is not None:
            checks = "; ".join(check.describe() for check in (gain, neighbours) if check is not None)
            nothing = "learned nothing usable without labels: " if label_free else ""
            warnings.warn(
                f"{self.config.loss}: {nothing}the selected model is not better than the untrained "
                f"backbone's own features ({checks}); export refuses it, keep serving the untrained backbone",
                NoGainWarning,
                stacklevel=2,
            )
        return summary
