"""A training run directory: ``config.json``, ``metrics.jsonl``, ``checkpoints/{last,best}.pt`` and
``summary.json``, every file written to a temporary name and renamed into place.

Each file has one typed record and is read and written here only: :class:`RunSummary` (``summary.json``),
:class:`BestCheckpoint` and :class:`LastCheckpoint` (with its :class:`TrainState`). On disk they stay the
string-keyed JSON and ``torch.save`` dictionaries they always were, so runs written before the records
load as they are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    ValidationError,
    field_serializer,
    field_validator,
)

from foundation.atomic import atomic_path, atomic_write_text
from foundation.errors import InvalidInputError
from training.bootstrap import Interval
from training.config import TrainConfig
from training.feedback_gate import FeedbackGate

Metrics = dict[str, float]  # metric name -> value, as training.metrics.evaluate returns them
StateDict = dict[str, Any]  # a component's own state_dict (weights, optimiser, sampler, ...)


class RunDirError(InvalidInputError):
    """The directory is not a training run, or holds a run that cannot be continued as asked."""


class FrozenStageSummary(BaseModel):
    """What the frozen stage of a ``frozen_first`` fine-tuning run reached: its summary's ``frozen_stage``."""

    model_config = ConfigDict(frozen=True)

    best_step: int
    steps: int
    train_seconds: float
    val: Metrics
    beats_backbone: bool


# What a label-free run selects checkpoints on and the gate judges (training.label_free_data).
LABEL_FREE_SCORE = (
    "held-out photos: recall@1 of each photo's augmented view and its original among the held-out photos "
    "and their views (view -> original, original -> view)"
)


# A bootstrap interval in a record: written with its verdict, read back from that dict.
IntervalRecord = Annotated[
    Interval,
    BeforeValidator(lambda value: Interval.from_dict(value) if isinstance(value, dict) else value),
    PlainSerializer(Interval.to_dict),
]


class NeighbourhoodCheck(BaseModel):
    """The label-free gate's second check (training.label_free_data): the validation photos' neighbourhood
    agreement under a strong view, the selected checkpoint against the untrained backbone."""

    model_config = ConfigDict(frozen=True)

    neighbours: int  # the neighbourhood's size
    untrained: float
    trained: float
    interval: IntervalRecord  # of trained - untrained, photos resampled
    seconds: float  # what the check cost: embedding the folder and the strong views, and the search

    @property
    def passed(self) -> bool:
        return self.interval.verdict == "better"

    def describe(self) -> str:
        interval = self.interval
        return (
            f"neighbourhood agreement of held-out photos under a strong view {100 * self.trained:.2f}% vs "
            f"{100 * self.untrained:.2f}% untrained, difference {100 * interval.difference:+.2f} "
            f"({100 * interval.level:.0f}% CI [{100 * interval.low:+.2f}, {100 * interval.high:+.2f}]): "
            f"{interval.verdict}"
        )


class PseudoLabelRefresh(BaseModel):
    """One re-clustering of a label-free run's loose photos: at which step, how many clusters, their sizes."""

    model_config = ConfigDict(frozen=True)

    step: int
    clusters: int
    sizes: list[int]  # photos per cluster, largest first


class LabelFreeRecord(BaseModel):
    """A label-free run's photos and how its pseudo-labels evolved: its summary's ``label_free``."""

    model_config = ConfigDict(frozen=True)

    labelled_photos: int  # training photos in class folders (real labels)
    loose_photos: int  # training photos pseudo-labelled
    held_out_photos: dict[str, int]  # split -> photos held out for the label-free score
    copies_merged: int  # photos that are byte or edited copies of another, merged into its pseudo-class
    score: str  # what validation and test metrics measure instead of class retrieval
    refreshes: list[PseudoLabelRefresh]
    # The gate's second check, scored where the first found the selected checkpoint better (None: it did
    # not, or the run finished before the gate had it)
    neighbours: NeighbourhoodCheck | None = None


class RunSummary(BaseModel):
    """``summary.json``: the finished run, its selected step and its test evaluation.

    Fields recorded later than the first runs are optional, so that those runs still load: ``val_backbone``,
    ``beats_backbone``, ``validation_gain``, ``frozen_stage`` (fine-tuning runs with a frozen first stage
    only) and ``failure`` (failed runs only). Written without the fields a run lacks, in this order: the bytes
    the trainer always wrote.
    """

    model_config = ConfigDict(frozen=True)

    loss: str
    mode: str
    steps: int
    stopped_early: bool
    best_step: int
    train_seconds: float
    val: Metrics
    val_backbone: Metrics | None = None
    beats_backbone: bool | None = None
    validation_gain: Interval | None = None
    test: Metrics
    test_backbone: Metrics
    skipped_images: int
    frozen_stage: FrozenStageSummary | None = None
    failure: str | None = None  # why the run learned nothing (a stuck loss, training.trainer.LossWatch)
    label_free: LabelFreeRecord | None = None  # a run without labels (or partly labelled): its pseudo-labels
    feedback: FeedbackGate | None = None  # a run on judgments (--feedback): what it used, its gate

    @field_validator("validation_gain", mode="before")
    @classmethod
    def _read_interval(cls, value: Any) -> Any:
        return Interval.from_dict(value) if isinstance(value, dict) else value

    @field_serializer("validation_gain")
    def _write_interval(self, interval: Interval | None) -> dict[str, Any] | None:
        return None if interval is None else interval.to_dict()

    def require_val_backbone(self) -> Metrics:
        if self.val_backbone is None:
            raise RunDirError(
                f"a {self.loss} run written before summary.json recorded the untrained backbone's "
                "validation metrics: train it again in a new directory"
            )
        return self.val_backbone

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``summary.json`` (the fields a run lacks left out)."""
        return self.model_dump(exclude_none=True)


@dataclass
class TrainState:
    """A run's progress: what ``checkpoints/last.pt`` holds besides the components' own states."""

    step: int = 0
    best_step: int = 0
    best_score: float = -math.inf  # validation SELECTION_METRIC of the best step
    since_best: int = 0  # validations since the best one (early stopping's patience)
    stopped: bool = False  # early stopping ended the run
    elapsed: float = 0.0  # seconds in training steps, validation excluded

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any]) -> TrainState:
        return cls(**{field.name: checkpoint[field.name] for field in fields(cls)})


@dataclass(frozen=True)
class BestCheckpoint:
    """``checkpoints/best.pt``: the selected weights, their step and validation metrics."""

    objective: StateDict
    step: int
    val: Metrics

    def to_dict(self) -> dict[str, Any]:
        return {"objective": self.objective, "step": self.step, "val": self.val}

    @classmethod
    def from_dict(cls, checkpoint: dict[str, Any]) -> BestCheckpoint:
        return cls(objective=checkpoint["objective"], step=checkpoint["step"], val=checkpoint["val"])


@dataclass(frozen=True)
class LastCheckpoint:
    """``checkpoints/last.pt``: the progress and every component's state, all a run needs to continue.
    On disk the progress's fields sit beside the components' states in one dictionary."""

    progress: TrainState
    objective: StateDict
    optimizer: StateDict
    sampler: StateDict
    view_rng: Mapping[str, Any]  # numpy's bit generator state
    scaler: StateDict

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.progress),
            "objective": self.objective,
            "optimizer": self.optimizer,
            "sampler": self.sampler,
            "view_rng": self.view_rng,
            "scaler": self.scaler,
        }

    @classmethod
    def from_dict(cls, checkpoint: dict[str, Any]) -> LastCheckpoint:
        return cls(
            progress=TrainState.from_checkpoint(checkpoint),
            objective=checkpoint["objective"],
            optimizer=checkpoint["optimizer"],
            sampler=checkpoint["sampler"],
            view_rng=checkpoint["view_rng"],
            scaler=checkpoint["scaler"],
        )


class RunDirectory:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.config_path = path / "config.json"
        self.metrics_path = path / "metrics.jsonl"
        self.summary_path = path / "summary.json"
        self.checkpoints = path / "checkpoints"

    def checkpoint_path(self, name: str) -> Path:
        return self.checkpoints / f"{name}.pt"

    def read_config(self) -> TrainConfig | None:
        if not self.config_path.exists():
            return None
        try:
            return TrainConfig.model_validate_json(self.config_path.read_text())
        except ValidationError as err:  # not a run's config.json: a damaged file, not a bug
            raise RunDirError(str(err)) from err

    def require_config(self) -> TrainConfig:
        config = self.read_config()
        if config is None:
            raise RunDirError(f"{self.path} is not a training run (no config.json)")
        return config

    def write_config(self, config: TrainConfig) -> None:
        atomic_write_text(self.config_path, config.model_dump_json(indent=2) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def write_metrics(self, records: list[dict[str, Any]]) -> None:
        """Rewrite the whole log (small): an append could leave a torn last line after a crash."""
        atomic_write_text(self.metrics_path, "".join(json.dumps(record) + "\n" for record in records))

    def _save_checkpoint(self, name: str, checkpoint: dict[str, Any]) -> None:
        with atomic_path(self.checkpoint_path(name)) as temporary:
            torch.save(checkpoint, temporary)

    def _load_checkpoint(self, name: str) -> dict[str, Any] | None:
        path = self.checkpoint_path(name)
        if not path.exists():
            return None
        return torch.load(path, map_location="cpu", weights_only=True)

    def save_best(self, best: BestCheckpoint) -> None:
        self._save_checkpoint("best", best.to_dict())

    def load_best(self) -> BestCheckpoint | None:
        checkpoint = self._load_checkpoint("best")
        return None if checkpoint is None else BestCheckpoint.from_dict(checkpoint)

    def require_best(self) -> BestCheckpoint:
        best = self.load_best()
        if best is None:
            raise RunDirError(f"{self.path} has no checkpoints/best.pt yet")
        return best

    def save_last(self, last: LastCheckpoint) -> None:
        self._save_checkpoint("last", last.to_dict())

    def load_last(self) -> LastCheckpoint | None:
        checkpoint = self._load_checkpoint("last")
        return None if checkpoint is None else LastCheckpoint.from_dict(checkpoint)

    def require_last(self) -> LastCheckpoint:
        last = self.load_last()
        if last is None:
            raise RunDirError(f"{self.path} has no checkpoints/last.pt yet")
        return last

    def read_summary(self) -> RunSummary | None:
        if not self.summary_path.exists():
            return None
        try:
            return RunSummary.model_validate(json.loads(self.summary_path.read_text()))
        except ValidationError as err:  # not a run's summary.json: a damaged file, not a bug
            raise RunDirError(f"{self.summary_path}: {err}") from err

    def write_summary(self, summary: RunSummary) -> None:
        atomic_write_text(self.summary_path, json.dumps(summary.to_dict(), indent=2) + "\n")
