"""A training run's configuration: everything that decides its result, saved as ``config.json``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from foundation import defaults
from training.precision import Precision

Mode = Literal["frozen", "partial", "finetune"]
LabelSource = Literal["folders", "none"]  # none: class folders are ignored, the run is label-free
CopyTier = Literal[
    "exact", "edited"
]  # the duplicate finder's tiers a label-free run merges (training.copies)
AUGMENT_MIN_AREA = 0.35  # random resized crops' smallest area fraction, as in the papers' crop augmentation

# Fields that may change when a run is resumed (they do not change what the steps already taken computed).
RESUMABLE_FIELDS = frozenset(
    {
        "max_steps",
        "patience",
        "min_steps",
        "workers",
        "cache_dir",
        "eval_batch_size",
        "recipe",
        "compute",
        "time_budget",
    }
)


class TrainConfig(BaseModel):
    """Defaults follow the measurements in the training issue: Adam at lr 1e-4 on a PCA-initialised head
    peaks on Cars196 around 1,500 steps, so runs are capped at 3,000 steps with early stopping."""

    model_config = ConfigDict(extra="forbid")

    loss: str
    data: str | None = Field(
        None, description="the image folder or CSV; none: the judgments of feedback alone"
    )
    feedback: str | None = Field(
        None,
        description="an index directory whose judgments (👍/👎) also train the run, as pairs "
        "(training.feedback_data); some are held out to gate it (training.feedback_gate)",
    )
    mode: Mode = "frozen"
    loss_hparams: dict[str, Any] = Field(default_factory=dict)
    backbone: str = defaults.BACKBONE
    embedding_dim: int = Field(512, ge=1)
    head_hidden: int = Field(1024, ge=1)
    embedding_scale: float = Field(1.0, gt=0, description="the loss sees the head output times this")
    unit_embeddings: bool = Field(False, description="the loss sees L2-normalised head outputs (x scale)")
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    backbone_lr_factor: float = Field(
        0.1, gt=0, description="finetune: backbone lr = lr x this (papers' 10x)"
    )
    max_steps: int = Field(3000, ge=0)
    eval_every: int = Field(0, ge=0, description="steps between validations; 0 = one epoch")
    time_budget: float | None = Field(
        None,
        gt=0,
        description="seconds of training steps (validation excluded) after which the run validates, "
        "keeps its best checkpoint and stops; none: max_steps decides",
    )
    patience: int = Field(8, ge=1, description="validations without improvement before stopping")
    min_steps: int = Field(
        0, ge=0, description="early stopping never ends a run before this step (losses that start slowly)"
    )
    classes_per_batch: int | None = Field(None, ge=1, description="override the loss's batch layout")
    samples_per_class: int | None = Field(None, ge=1)
    views: int = Field(0, ge=0, description="frozen: augmented feature views per training image")
    view_seed: int | None = Field(
        None,
        ge=0,
        description="seed of the augmented views' crops (default: seed); fixed, seeds share a cache",
    )
    labels: LabelSource = Field(
        "folders",
        description="folders: class folders label their photos, loose photos are pseudo-labelled; none: "
        "every photo is pseudo-labelled (training.label_free_data)",
    )
    copies: CopyTier = Field(
        "edited",
        description="without labels: copies of one photo that train as one (certain positives): exact "
        "(byte copies) or edited (also the duplicate finder's edited copies: crops, turns, resizes, "
        "re-encodes)",
    )
    train_classes: int | None = Field(None, ge=1)
    val_fraction: float = Field(0.2, gt=0, lt=1)
    fold: int | None = Field(
        None, ge=0, description="cross-validation: test on this fold of the training classes instead"
    )
    folds: int = Field(3, ge=2, description="cross-validation: class folds of the training classes")
    clusters_per_class: int = Field(4, ge=1, description="magnet: k-means clusters per class")
    cluster_refresh: int = Field(250, ge=1, description="magnet: steps between cluster index rebuilds")
    seed: int = 0
    cache_dir: str | None = Field(None, description="feature cache (default: RUN_DIR/cache)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Precision = Field(
        "auto",
        description="partial/finetune: autocast of backbone and head (the loss stays float32); auto = "
        "bfloat16 where the CPU or GPU has it natively, float16 on older GPUs, else float32; fp32 = off",
    )
    channels_last: bool = Field(True, description="partial/finetune: convolutions in channels-last format")
    backbone_chunk: int = Field(
        32,
        ge=0,
        description="finetune: images per backbone pass, activations recomputed in backward (bounds memory; "
        "the loss still sees the whole batch); 0 = the whole batch at once",
    )
    frozen_first: bool = Field(
        False,
        description="finetune: first train the head alone on cached features (the frozen mode, its own step "
        "budget), then fine-tune the whole network from that head",
    )
    train_size: int | None = Field(
        None,
        ge=32,
        description="finetune: side in pixels of the augmented training crops (default: the backbone's input "
        "size); validation, test and the exported model keep the input size",
    )
    min_crop_area: float = Field(
        AUGMENT_MIN_AREA,
        gt=0,
        le=1,
        description="finetune: smallest area fraction of an augmented training crop (random resized crop)",
    )
    workers: int = Field(2, ge=0, description="finetune: image loading processes")
    eval_batch_size: int = Field(64, ge=1)
    recipe: dict[str, Any] | None = Field(
        None, description="where the settings came from (training/recipes.py): name, values, overrides"
    )
    compute: dict[str, Any] | None = Field(
        None, description="what the run used (set by the trainer): device, precision, channels_last, why"
    )

    @model_validator(mode="before")
    @classmethod
    def _from_amp(cls, values: Any) -> Any:
        """Runs saved before ``precision`` existed have ``amp`` (mixed precision on GPUs, on or off)."""
        if isinstance(values, dict) and "amp" in values:
            values = dict(values)
            values.setdefault("precision", "auto" if values.pop("amp") else "fp32")
        return values

    @model_validator(mode="after")
    def _something_to_train_on(self) -> TrainConfig:
        if self.data is None and self.feedback is None:
            raise ValueError("a run trains on data, on the judgments of feedback, or on both: neither given")
        return self

    @property
    def effective_view_seed(self) -> int:
        return self.seed if self.view_seed is None else self.view_seed

    def resume_conflicts(self, saved: TrainConfig) -> list[str]:
        """Fields that differ from the saved run's config and would make resuming it wrong."""
        ours, theirs = self.model_dump(), saved.model_dump()
        return sorted(key for key in ours if key not in RESUMABLE_FIELDS and ours[key] != theirs[key])
