"""Labelled image collections and the deep-metric-learning class split.

A collection comes from an ImageFolder-style directory (label = the image's folder, relative to the root)
or from a CSV with the columns ``path,label`` and optionally ``split`` (paths relative to the CSV file).
Asked to (``loose=True``), photos directly under the folder are kept with the label :data:`LOOSE`: a
label-free run (``training.label_free_data``) gives them pseudo-labels.
The papers' protocol splits *classes*, not images: training sees the first half of the classes (sorted by
name), retrieval is evaluated on the unseen second half. Checkpoints are selected on a validation split of
whole classes carved from the training classes the same way, the *last* ones in sorted order, so that
selection mimics the unseen-class test and never touches the test classes. (On Cars196, whose class names
start with the make, a random subset of training classes shares its makes with the classes trained on and
rewarded make-specific features that did not carry over to the unseen makes of the test half.)
"""

from __future__ import annotations

import csv
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.gallery.files import list_images
from foundation.errors import InvalidInputError

SPLITS = ("train", "val", "test")
MIN_VAL_CLASSES = 2  # Recall@1 over a single class is trivially 100%
MIN_TRAIN_CLASSES = 2  # pair/triplet losses need negatives
LOOSE = -1  # the label of a photo in no class folder (or of every photo under --labels none)


class DataError(InvalidInputError):
    """The data source is missing, malformed or too small for the requested split."""


@dataclass(frozen=True)
class LabelledImages:
    """Image files with integer labels; ``class_names[label]`` names each class."""

    root: Path
    paths: tuple[str, ...]  # relative to ``root``
    labels: np.ndarray  # int64, indices into class_names
    class_names: tuple[str, ...]
    splits: tuple[str, ...] | None = None  # per image, from a CSV split column

    def __len__(self) -> int:
        return len(self.paths)

    def files(self, indices: Sequence[int] | np.ndarray | None = None) -> list[Path]:
        chosen = range(len(self)) if indices is None else indices
        return [self.root / self.paths[i] for i in chosen]


@dataclass(frozen=True)
class ClassSplit:
    """Image indices of each split of a :class:`LabelledImages`; the splits share no class."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    # Every image of the classes training may draw from (train + val, plus a cross-validation fold's test
    # classes): augmented views are cached for these, so one cache serves every validation share and fold.
    pool: np.ndarray

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise KeyError(name)
        return getattr(self, name)


def load_labelled_images(source: Path, *, loose: bool = False) -> LabelledImages:
    """Read an ImageFolder-style directory or a ``path,label[,split]`` CSV file; ``loose``: keep the photos
    directly under the folder, labelled :data:`LOOSE` (otherwise they are ignored, with a warning)."""
    if source.is_dir():
        return _from_folder(source, loose)
    if source.is_file() and source.suffix.lower() == ".csv":
        return _from_csv(source)
    raise DataError(f"{source} is neither an image folder nor a .csv file")


def without_labels(images: LabelledImages) -> LabelledImages:
    """The same photos, every one :data:`LOOSE` (``--labels none``: class folders ignored)."""
    return replace(images, labels=np.full(len(images), LOOSE, dtype=np.int64), class_names=(), splits=None)


def _from_folder(root: Path, loose: bool) -> LabelledImages:
    paths: list[str] = []
    names: list[str | None] = []
    ignored = 0
    for path in list_images(root):
        in_class = path.parent != root
        if not (in_class or loose):
            ignored += 1
            continue
        paths.append(path.relative_to(root).as_posix())
        names.append(path.parent.relative_to(root).as_posix() if in_class else None)
    if ignored:
        warnings.warn(f"ignored {ignored} images directly under {root} (no class folder)", stacklevel=3)
    return _index_labels(root, paths, names, None, source=root)


def _from_csv(table: Path) -> LabelledImages:
    with table.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = {name.strip() for name in reader.fieldnames or ()}
        if not {"path", "label"} <= columns:
            raise DataError(f"{table} needs the columns path,label[,split]; it has {sorted(columns)}")
        rows = [{key.strip(): (value or "").strip() for key, value in row.items()} for row in reader]
    root = table.parent
    missing = [row["path"] for row in rows if not (root / row["path"]).is_file()]
    if missing:
        raise DataError(f"{len(missing)} files listed in {table} do not exist, e.g. {missing[:3]}")
    splits = None
    if "split" in columns:
        splits = tuple(row["split"].lower() for row in rows)
        unknown = sorted(set(splits) - set(SPLITS))
        if unknown:
            raise DataError(f"{table}: unknown split value(s) {unknown}; use {', '.join(SPLITS)}")
    names: list[str | None] = [row["label"] for row in rows]
    return _index_labels(root, [row["path"] for row in rows], names, splits, source=table)


def _index_labels(
    root: Path, paths: list[str], names: list[str | None], splits: tuple[str, ...] | None, *, source: Path
) -> LabelledImages:
    if not paths:
        raise DataError(f"no labelled images in {source}")
    class_names = tuple(sorted({name for name in names if name is not None}))
    lookup = {name: index for index, name in enumerate(class_names)}
    labels = np.array([LOOSE if name is None else lookup[name] for name in names], dtype=np.int64)
    return LabelledImages(root, tuple(paths), labels, class_names, splits)


def split_classes(
    data: LabelledImages,
    *,
    train_classes: int | None = None,
    val_fraction: float = 0.2,
    fold: int | None = None,
    folds: int = 3,
) -> ClassSplit:
    """The DML split: train / val / test image indices over disjoint classes.

    Without a split column the first half of the classes (sorted by name), or the first
    ``train_classes``, are for training and the rest for testing. A CSV split column decides per image
    instead (a class must not appear in two splits). Unless the CSV names ``val`` images, the last
    ``val_fraction`` of the training classes (at least two) is held out for validation.

    Cross-validation over the training classes: ``fold`` k of ``folds`` makes the k-th contiguous block of
    the training (and validation) classes the test split; the real test classes are not used at all.
    """
    num_classes = len(data.class_names)
    if data.splits is not None and train_classes is None:
        split_of = np.asarray(data.splits)
        train, val, test = (np.flatnonzero(split_of == name) for name in SPLITS)
    else:
        cut = num_classes // 2 if train_classes is None else train_classes
        if not 0 < cut < num_classes:
            raise DataError(f"--train-classes must be between 1 and {num_classes - 1}, got {cut}")
        train = np.flatnonzero(data.labels < cut)
        test = np.flatnonzero(data.labels >= cut)
        val = np.zeros(0, dtype=np.int64)
    _check_disjoint(data, {"train": train, "val": val, "test": test})
    pool = np.sort(np.concatenate([train, val]))
    if fold is not None:
        train, test = _fold(data, pool, fold, folds)
        val = np.zeros(0, dtype=np.int64)
    if len(val) == 0:
        train, val = _carve_validation(data, train, val_fraction)
    for name, indices in (("train", train), ("val", val), ("test", test)):
        if len(indices) == 0:
            raise DataError(f"the {name} split is empty")
    return ClassSplit(train=train, val=val, test=test, pool=pool)


def _fold(data: LabelledImages, pool: np.ndarray, fold: int, folds: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) of the pool: the ``fold``-th of ``folds`` contiguous blocks of its classes is test."""
    classes = np.unique(data.labels[pool])
    if not 0 <= fold < folds <= len(classes):
        raise DataError(
            f"fold must be in 0..{folds - 1} and folds at most {len(classes)}, got {fold}/{folds}"
        )
    is_test = np.isin(data.labels[pool], np.array_split(classes, folds)[fold])
    return pool[~is_test], pool[is_test]


def _check_disjoint(data: LabelledImages, splits: dict[str, np.ndarray]) -> None:
    classes = {name: set(data.labels[indices].tolist()) for name, indices in splits.items()}
    for first, second in (("train", "val"), ("train", "test"), ("val", "test")):
        shared = classes[first] & classes[second]
        if shared:
            examples = [data.class_names[label] for label in sorted(shared)[:3]]
            raise DataError(f"classes {examples} appear in both the {first} and the {second} split")


def _carve_validation(
    data: LabelledImages, train: np.ndarray, val_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    classes = np.unique(data.labels[train])
    count = max(MIN_VAL_CLASSES, round(val_fraction * len(classes)))
    if len(classes) - count < MIN_TRAIN_CLASSES:
        raise DataError(
            f"{len(classes)} training classes are too few to hold out {count} for validation and keep "
            f"{MIN_TRAIN_CLASSES} to train on"
        )
    held_out = classes[-count:]  # labels index the sorted class names
    is_val = np.isin(data.labels[train], held_out)
    return train[~is_val], train[is_val]
