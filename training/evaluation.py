"""Evaluate a training run or an exported ONNX model on a labelled image collection.

An exported model is evaluated exactly as it is served (engine's :class:`Embedder`: decoding,
preprocessing, onnxruntime). A run is evaluated from its best checkpoint: on cached backbone features when
it trained the head only, on images when it fine-tuned the backbone.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from engine.decode.images import ImageDecodeError, load_image_file
from engine.model.embedder import Embedder
from foundation.progress import progress_bar
from training.backbone import BACKBONES
from training.config import TrainConfig
from training.data import LabelledImages, load_labelled_images, split_classes
from training.metrics import evaluate
from training.model import TrainingObjective, build_objective
from training.run_dir import RunDirectory
from training.trainer import cache_directory, prepare_data
from training.workloads import CachedWorkload, FinetuneWorkload

EvalSplit = Literal["test", "val", "all"]


def _split_indices(images: LabelledImages, split: EvalSplit, train_classes: int | None) -> np.ndarray:
    if split == "all":
        return np.arange(len(images))
    return split_classes(images, train_classes=train_classes)[split]


def evaluate_onnx(
    model_path: Path,
    data: Path,
    *,
    split: EvalSplit = "test",
    train_classes: int | None = None,
    batch_size: int = 32,
    progress: bool = True,
) -> dict[str, float]:
    """Metrics of an exported ``model.onnx`` on ``split`` of ``data`` (unreadable images skipped)."""
    embedder = Embedder(model_path)
    images = load_labelled_images(data)
    indices = _split_indices(images, split, train_classes)
    draft = embedder.card.preprocessing.resize_size
    vectors, labels, batch = [], [], []
    for index in progress_bar(indices, desc="embedding", unit="img", disable=not progress):
        path = images.root / images.paths[index]
        try:
            batch.append(load_image_file(path, draft_size=draft))
            labels.append(images.labels[index])
        except (ImageDecodeError, OSError) as err:
            warnings.warn(f"skipped unreadable image {path}: {err}", stacklevel=2)
        if len(batch) == batch_size:
            vectors.append(embedder.embed(batch))
            batch = []
    if batch:
        vectors.append(embedder.embed(batch))
    return evaluate(np.concatenate(vectors), np.asarray(labels))


@dataclass(frozen=True)
class RunEmbeddings:
    """One split embedded by a run's best checkpoint and by the untrained backbone, row for row.

    ``untrained`` holds the pretrained backbone's pooled features: what ``dmlsearch export`` without a run
    serves, so the comparison answers "is serving this run better than serving no training at all?".
    """

    config: TrainConfig
    objective: TrainingObjective
    trained: np.ndarray
    untrained: np.ndarray
    labels: np.ndarray
    files: list[Path]
    class_names: tuple[str, ...]


def embed_run(
    run_path: Path,
    data: Path | None = None,
    *,
    split: EvalSplit = "test",
    progress: bool = True,
    last: bool = False,
) -> RunEmbeddings:
    """Embed ``split`` of ``data`` (default: the data the run trained on) with the run's best checkpoint,
    or with ``last`` its last one (to compare runs at the same step)."""
    run = RunDirectory(run_path)
    config = run.require_config()
    weights = run.require_last().objective if last else run.require_best().objective
    if data is not None:  # its class folders (or CSV labels) label it, also for a run trained without labels
        config = config.model_copy(update={"data": str(data), "labels": "folders", "feedback": None})
    # Embedding needs only the serving view: a run's augmented training views are not extracted again.
    serving_only = config.model_copy(update={"views": 0})
    prepared = prepare_data(serving_only, cache_directory(config, run_path), progress=progress)
    objective = build_objective(config, prepared.features["train"].shape[1])
    objective.load_state_dict(weights)
    names = ("train", "val", "test") if split == "all" else (split,)
    labels = np.concatenate([prepared.labels(name) for name in names])
    files = [file for name in names for file in prepared.files(name)]
    device = torch.device("cpu")
    workload: CachedWorkload | FinetuneWorkload
    if config.mode != "finetune":
        inputs = {"eval": np.concatenate([prepared.inputs[name] for name in names])}
        workload = CachedWorkload(objective, prepared.train_views, inputs, device)
    else:
        preprocessing = BACKBONES[config.backbone].preprocessing
        views = prepared.seeded_views(names)  # a label-free run's held-out views, made as it made them
        workload = FinetuneWorkload(
            objective,
            {"eval": files},
            preprocessing,
            device,
            workers=config.workers,
            views=None if views is None else {"eval": views},
        )
    return RunEmbeddings(
        config=config,
        objective=objective,
        trained=workload.embed("eval"),
        untrained=np.concatenate([prepared.features[name] for name in names]),
        labels=labels,
        files=files,
        class_names=prepared.class_names,
    )
