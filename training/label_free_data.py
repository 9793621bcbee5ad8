"""Label-free runs: which photos are one, which are held out, and the score that stands in for labels.

A run is label-free when its folder holds loose photos (directly under it, in no class folder) or when told
to ignore class folders (``--labels none``). Photos in class folders keep their labels (a partly labelled
folder); the loose ones train on pseudo-labels (:mod:`training.pseudo_labels`).

* Copies: byte copies and edited copies (the duplicate finder's edited tier, :mod:`training.copies`) of
  one photo are one photo, certain positives. A loose copy of a labelled photo takes its label (a real
  label wins); loose copies share one pseudo-label in training and one id in the held-out check, and
  never straddle the split.
* The held-out check: :data:`HELD_OUT_SHARE` of the loose photos (whole copy groups, seeded) for validation
  and as many for test; none of them trains. Each held-out photo is embedded twice, as it is served and as
  one augmented view (view :data:`EVAL_VIEW` of the feature cache, :data:`EVAL_AUGMENTATION`), both rows
  labelled with the photo's id.
  Recall@1 over those rows is the share of images whose nearest other image is the same photo's other
  version (view -> original and original -> view): whether the embedding still tells a photo it never saw
  from the others under the changes training teaches it to ignore. The trainer selects checkpoints on it
  as a labelled run does on validation Recall@1.
* The gate asks a second check to agree: neighbourhood agreement
  (:func:`training.metrics.neighbourhood_agreement`), the share of a validation photo's :data:`NEIGHBOURS`
  nearest photos of the folder that a strong view of it (:data:`GATE_AUGMENTATION`: SimCLR's crops, colour
  jitter and grey) also has among its nearest. A run is served only where the selected checkpoint is
  *better* than the untrained backbone on both, else it learned nothing usable and the untrained model
  stays served. On Cars196 class folds (bench/results/label_free_gate*.md) the first check alone served
  runs whose class Recall@1 had fallen (5 of 12 cases): training on two views of each photo raises it
  whatever happens to the classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.config import LabelSource
from training.copies import byte_copies
from training.data import LOOSE, DataError, LabelledImages, load_labelled_images, without_labels
from training.features import Augmentation

# Held out for validation, and as many for test: a tenth each (at least MIN_HELD_OUT photos) leaves most of
# a folder to train on while a few hundred photos of a few thousand give a Recall@1 interval of some points.
HELD_OUT_SHARE = 0.1
MIN_HELD_OUT = 4
# Fewer loose photos than this cannot hold out two checks and still train: a labelled folder's few stray
# photos are then ignored (with a warning) as before label-free runs existed.
MIN_LOOSE_PHOTOS = 20
EVAL_VIEW = 1  # the feature cache's augmented view that held-out photos are embedded in besides their own
EVAL_AUGMENTATION: Augmentation = "crop"  # how that view is made: as training's augmented crops
# The gate's second check (module docstring), as bench/lib/label_free_gate.py measured it: 10 neighbours.
NEIGHBOURS = 10
GATE_AUGMENTATION: Augmentation = "strong"  # the validation photos' view of the neighbourhood check


@dataclass(frozen=True)
class LabelFreePlan:
    """A label-free run's photos: labels (real, or LOOSE), copy groups, and the split by photo."""

    images: LabelledImages  # labels: a class, or LOOSE (a copy of a labelled photo takes its class)
    copies: np.ndarray  # per image: the index of the first image of its group of copies
    train: np.ndarray  # image indices: every labelled photo and the loose photos not held out
    val: np.ndarray
    test: np.ndarray

    def held_out_labels(self, indices: np.ndarray) -> np.ndarray:
        """The id of each held-out photo's rows: its copy group, so copies answer each other."""
        return self.copies[indices]


def label_free_images(source: Path, labels: LabelSource) -> LabelledImages | None:
    """The folder's photos, loose ones labelled LOOSE, when its run is label-free; None for a labelled run."""
    try:
        images = load_labelled_images(source, loose=source.is_dir())
    except DataError:
        if labels == "none":
            raise
        return None  # nothing to train on: the labelled run's loading says why, as it always did
    if labels == "none":
        images = without_labels(images)
    loose = int((images.labels == LOOSE).sum())
    labelled = len(images) - loose
    if loose >= MIN_LOOSE_PHOTOS:
        return images
    if labelled == 0:
        raise DataError(
            f"{source} holds {loose} photos: a run without labels needs at least {MIN_LOOSE_PHOTOS}"
        )
    return None


def is_label_free(source: Path, labels: LabelSource) -> bool:
    """Whether a run on ``source`` trains without labels (all or some of its photos pseudo-labelled)."""
    return label_free_images(source, labels) is not None


def plan_label_free(images: LabelledImages, *, seed: int, copies: np.ndarray | None = None) -> LabelFreePlan:
    """Copies merged (a real label wins), then whole loose copy groups held out for validation and test.

    ``copies``: per image, the first image of its group of copies (:func:`training.copies.copy_groups`:
    byte and edited copies); byte copies alone when None."""
    copies = byte_copies(images.files()) if copies is None else copies
    labels = images.labels.copy()
    for group in np.unique(copies):
        members = np.flatnonzero(copies == group)
        known = labels[members][labels[members] != LOOSE]
        if len(known):  # the loose copies take the first real label; a labelled copy keeps its own
            labels[members[labels[members] == LOOSE]] = known[0]
    groups = np.unique(copies[labels == LOOSE])
    count = max(MIN_HELD_OUT, round(HELD_OUT_SHARE * len(groups)))
    if len(groups) < 2 * count + MIN_HELD_OUT:
        raise DataError(
            f"{len(groups)} distinct loose photos are too few to hold out {count} for validation and "
            f"{count} for test and train on the rest"
        )
    order = np.random.default_rng(seed).permutation(groups)
    val_groups, test_groups = order[:count], order[count : 2 * count]
    is_val, is_test = np.isin(copies, val_groups), np.isin(copies, test_groups)
    return LabelFreePlan(
        images=LabelledImages(images.root, images.paths, labels, images.class_names),
        copies=copies,
        train=np.flatnonzero(~is_val & ~is_test),
        val=np.flatnonzero(is_val),
        test=np.flatnonzero(is_test),
    )
