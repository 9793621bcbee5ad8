"""Where training batches come from and how a split is embedded, per mode.

* :class:`CachedWorkload`: inputs are cached backbone outputs (one of the augmentation views per sample):
  pooled features in frozen mode, so a step costs a head forward/backward only; the maps entering the
  backbone's last stage in partial mode, so a step also trains that stage.
* :class:`FinetuneWorkload`: inputs are augmented images decoded by DataLoader workers; the backbone trains.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from engine.decode.images import load_image_file
from engine.model.model_card import Preprocessing
from engine.model.preprocess import to_tensor
from foundation.stopping import obey_stop_signals_from_owner, stop_signals_blocked
from training.config import AUGMENT_MIN_AREA
from training.features import Augmentation, augment_transform, seeded_view, view_transform
from training.model import TrainingObjective
from training.precision import model_inputs
from training.samplers import ClassBalancedSampler

Batch = tuple[np.ndarray, torch.Tensor]  # (indices into the training split, inputs)


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Put ``module`` in eval mode for the block, then back in the mode it was in."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def distinct_views(indices: np.ndarray, drawn: np.ndarray, count: int) -> np.ndarray:
    """The cached view (of ``count``) of each example: the one ``drawn`` at random, except that an example
    repeated in a batch (a label-free run draws each photo twice, as its certain positive pair) takes the
    views after its first one's, so that its copies are different pictures while there are views enough."""
    views = drawn.copy()
    seen: dict[int, tuple[int, int]] = {}  # example -> (its first view, copies so far)
    for position, index in enumerate(indices.tolist()):
        if index in seen:
            first, copies = seen[index]
            views[position] = (first + copies) % count
            seen[index] = (first, copies + 1)
        else:
            seen[index] = (int(drawn[position]), 1)
    return views


class CachedWorkload:
    """Training on cached inputs: ``train_views`` is (views, n_train, *shape), view 0 the serving one.

    Inputs may be stored as float16 (trunk maps); the model always sees float32.
    """

    EVAL_BATCH_ELEMENTS = 1 << 22  # input values per evaluation batch: bounds the last stage's activations

    def __init__(
        self,
        objective: TrainingObjective,
        train_views: np.ndarray,
        eval_inputs: dict[str, np.ndarray],
        device: torch.device,
        *,
        channels_last: bool = False,
    ) -> None:
        self.objective = objective
        self.train_views = torch.from_numpy(train_views)
        self.eval_inputs = {"train": train_views[0], **eval_inputs}
        self.device = device
        self.channels_last = channels_last
        self.batch_size = max(1, self.EVAL_BATCH_ELEMENTS // int(np.prod(train_views.shape[2:])))

    def batches(self, sampler: ClassBalancedSampler, rng: np.random.Generator) -> Iterator[Batch]:
        while True:
            indices = sampler.next_indices()
            count = len(self.train_views)
            views = distinct_views(indices, rng.integers(0, count, size=len(indices)), count)
            yield indices, self._inputs(self.train_views[views, indices])

    def _inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        return model_inputs(inputs.to(self.device, torch.float32), self.channels_last)

    @torch.no_grad()
    def embed(self, split: str) -> np.ndarray:
        inputs = torch.from_numpy(self.eval_inputs[split])
        with eval_mode(self.objective):
            parts = [
                self.objective.embed(self._inputs(chunk)).float().cpu()
                for chunk in inputs.split(self.batch_size)
            ]
        return torch.cat(parts).numpy()


@dataclass(frozen=True)
class SeededViews:
    """Rows of an evaluated split shown as a seeded augmented view instead of as served (a label-free
    run's held-out check, :mod:`training.label_free_data`): the same pictures the feature cache holds."""

    positions: np.ndarray  # per row: the image's index in the list its view was made from; -1: served
    view: int
    seed: int
    augmentation: Augmentation = "crop"


class ImageFiles(Dataset):
    """Decoded, preprocessed images; augmented (random resized crop + flip) for training."""

    def __init__(
        self,
        files: Sequence[Path],
        preprocessing: Preprocessing,
        *,
        augment: float | None = None,
        views: SeededViews | None = None,
    ) -> None:
        """``augment``: the smallest area fraction of the random resized crops; None: no augmentation.
        ``views``: rows shown as a seeded view of the feature cache's (training.features.view_images)."""
        self.files = list(files)
        self.preprocessing = preprocessing
        self.augment = None if augment is None else augment_transform(preprocessing, augment)
        self.views = views
        self.view_transform = view_transform(preprocessing, views.augmentation if views else "crop")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        # Unreadable files were dropped when the features were extracted, so decoding succeeds here.
        image = load_image_file(self.files[index], draft_size=self.preprocessing.resize_size)
        if self.augment is not None:
            image = self.augment(image)
        if self.views is not None and (position := int(self.views.positions[index])) >= 0:
            image = seeded_view(image, position, self.views.view, self.views.seed, self.view_transform)
        return index, torch.from_numpy(to_tensor([image], self.preprocessing)[0])


def training_preprocessing(preprocessing: Preprocessing, train_size: int | None) -> Preprocessing:
    """The preprocessing of training crops: ``preprocessing`` at ``train_size`` pixels when one is given.

    Smaller training crops make a step cheaper in proportion to their area. Evaluating at a larger size
    than training suits random-resized-crop training, whose crops show objects larger than whole images
    do (Touvron et al. 2019, "Fixing the train-test resolution discrepancy").
    """
    if train_size is None:
        return preprocessing
    return preprocessing.model_copy(update={"input_size": train_size, "resize_size": train_size})


class StopSafeLoader(DataLoader):
    """A DataLoader whose decoding workers outlive the SIGTERM and SIGINT that often reach every process
    of the run (``foundation.stopping``): the trainer saves its checkpoint, then ends the workers; a worker
    killed first would make the DataLoader raise instead. A worker still ends on a SIGTERM from the trainer's
    process, which is how the DataLoader, and multiprocessing at exit, end it. Workers start with both
    signals blocked: before ``worker_init_fn`` runs, a worker has torch's own SIGTERM handler, which dies
    whoever sent it.
    """

    def __init__(self, dataset: Dataset, **options: Any) -> None:
        super().__init__(dataset, worker_init_fn=_obey_the_trainer, **options)

    def __iter__(self) -> Any:
        with stop_signals_blocked():
            return super().__iter__()


def _obey_the_trainer(worker_id: int) -> None:
    obey_stop_signals_from_owner(os.getppid())


def _endless(sampler: ClassBalancedSampler) -> Iterator[list[int]]:
    while True:
        yield sampler.next_indices().tolist()


class FinetuneWorkload:
    """Training the whole network on images (GPU when present, mixed precision by the caller)."""

    def __init__(
        self,
        objective: TrainingObjective,
        files: dict[str, list[Path]],
        preprocessing: Preprocessing,
        device: torch.device,
        *,
        workers: int = 2,
        batch_size: int = 64,
        channels_last: bool = False,
        train_size: int | None = None,
        min_crop_area: float = AUGMENT_MIN_AREA,
        views: dict[str, SeededViews] | None = None,
    ) -> None:
        """``views``: per evaluated split, rows shown as a seeded augmented view (label-free runs)."""
        self.objective = objective
        self.files = files
        self.views = views or {}
        self.preprocessing = preprocessing
        self.train_preprocessing = training_preprocessing(preprocessing, train_size)
        self.min_crop_area = min_crop_area
        self.device = device
        self.workers = workers
        self.batch_size = batch_size
        self.channels_last = channels_last

    def batches(self, sampler: ClassBalancedSampler, rng: np.random.Generator) -> Iterator[Batch]:
        loader = StopSafeLoader(
            ImageFiles(self.files["train"], self.train_preprocessing, augment=self.min_crop_area),
            batch_sampler=_endless(sampler),
            num_workers=self.workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=False,
        )
        for indices, images in loader:
            yield indices.numpy(), model_inputs(images.to(self.device, non_blocking=True), self.channels_last)

    @torch.no_grad()
    def embed(self, split: str) -> np.ndarray:
        loader = StopSafeLoader(
            ImageFiles(self.files[split], self.preprocessing, views=self.views.get(split)),
            batch_size=self.batch_size,
            num_workers=self.workers,
        )
        parts = []
        # Float32, not mixed precision: validation must rank with the embeddings the ONNX model serves.
        with eval_mode(self.objective):
            for _, images in loader:
                parts.append(
                    self.objective.embed(model_inputs(images.to(self.device), self.channels_last))
                    .float()
                    .cpu()
                )
        return torch.cat(parts).numpy()
