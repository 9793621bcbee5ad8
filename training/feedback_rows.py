"""Judged photos as training rows (issue 40): their cached backbone features, beside a folder's or alone.

- With a data folder (labelled, or label-free): the judged photos of the training judgments are extra
  training rows after the folder's, except a photo that is one of the folder's training photos (the same
  file), which keeps its row. The folder's validation selects the checkpoint, as without judgments.
- Alone: the judged photos are the whole training set (:data:`~training.losses.pairs.UNLABELLED`, known
  only through their judgments); the validation rows are the photos of the validation judgments, labelled
  by their 👍 components (:meth:`~training.feedback_data.Closure.components`), so that Recall@1 among them
  selects the checkpoint; the test rows are the held-out judgments' photos, labelled the same way.

Either way the photos of the held-out judgments are the split ``judged``, which the gate embeds
(:mod:`training.feedback_gate`), and the unjudged sample (:attr:`~training.feedback_data.Feedback.unjudged`)
is the split ``unjudged``: each photo as served and as the label-free check's augmented view
(:data:`~training.label_free_data.EVAL_VIEW`, :data:`~training.label_free_data.EVAL_AUGMENTATION`), two rows
labelled with its item id, which the gate checks without labels.

Frozen mode feeds the head the pooled features. An index served by the pretrained backbone itself (its
model's fingerprint) already holds those features as its vectors: they are read from it, and no judged
photo is decoded (unless the run trains on augmented views). Otherwise a judged photo that cannot be read
is left out with its judgments, with a warning. Fine-tuning embeds every row from its photo:
:meth:`JudgedRows.photos` names the photos of the rows that the folder's images do not hold, and the
unjudged sample's views are made from the files as the feature cache made them (:attr:`UnjudgedRows.views`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from training.config import TrainConfig
from training.data import DataError, LabelledImages
from training.features import FeatureExtractor
from training.feedback_data import Closure, Feedback
from training.label_free_data import EVAL_AUGMENTATION, EVAL_VIEW
from training.losses.pairs import UNLABELLED
from training.workloads import SeededViews

if TYPE_CHECKING:
    from training.trainer import PreparedData

JUDGED_SPLIT = "judged"  # the eval split of the held-out judgments' photos
UNJUDGED_SPLIT = "unjudged"  # the eval split of the unjudged sample: as served, then as a view


@dataclass(frozen=True)
class JudgedRows:
    """Where the judgments are among a run's training rows."""

    feedback: Feedback  # without the judgments of unreadable photos
    row_items: np.ndarray  # per training row (the folder's first, then judged photos): its item, or -1
    data_rows: int  # the first rows, the folder's: what the loss layout's own sampler draws from
    held_out: list[int]  # the held-out judgments' items, the rows of split JUDGED_SPLIT
    unjudged: UnjudgedRows  # the unjudged sample, the rows of split UNJUDGED_SPLIT

    def photos(self, split: str) -> list[Path]:
        """The photos of ``split``'s rows that are not the folder's (all of JUDGED_SPLIT's and
        UNJUDGED_SPLIT's; in ``train``, those after the first ``data_rows``), as fine-tuning reads them."""
        feedback = self.feedback
        if split == UNJUDGED_SPLIT:
            return self.unjudged.files * 2  # as served, then as the check's view (UnjudgedRows.views)
        items = self.held_out if split == JUDGED_SPLIT else self.row_items[self.data_rows :].tolist()
        return [feedback.root / feedback.paths[item] for item in items]


@dataclass(frozen=True)
class _Extracted:
    features: np.ndarray  # (n, d) serving view of each readable item
    views: np.ndarray  # (1 + augmented views, n, d)
    row: dict[int, int]  # item -> its row


def _extract(
    config: TrainConfig, feedback: Feedback, cache_dir: Path, progress: bool
) -> tuple[Feedback, _Extracted]:
    items = feedback.items((*feedback.train, *feedback.val, *feedback.test))
    extractor = FeatureExtractor(cache_dir, config.backbone, progress=progress)
    served_is_backbone = extractor.embedder.fingerprint == feedback.model_fingerprint
    if served_is_backbone and config.views == 0 and config.mode == "frozen":  # fine-tuning reads every file
        features = np.stack([feedback.served[item] for item in items]).astype(np.float32)
        row = {item: k for k, item in enumerate(items)}
        return feedback, _Extracted(features, features[None], row)
    files = [feedback.root / feedback.paths[item] for item in items]
    base = extractor.extract(files)
    seed = config.effective_view_seed
    augmented = [
        extractor.extract(files, view=view, seed=seed).features for view in range(1, config.views + 1)
    ]
    unreadable = {item for item, ok in zip(items, base.ok, strict=True) if not ok}
    if unreadable:
        warnings.warn(
            f"left out {len(unreadable)} judged photos that cannot be read, with their judgments",
            stacklevel=3,
        )

        def keep(pairs: tuple) -> tuple:
            return tuple(p for p in pairs if not {p.query, p.result} & unreadable)

        feedback = replace(
            feedback, train=keep(feedback.train), val=keep(feedback.val), test=keep(feedback.test)
        )
    if not feedback.train or not feedback.test:
        raise DataError(f"{feedback.index}: too few readable judged photos to train and hold out judgments")
    row = {item: k for k, item in enumerate(items)}
    return feedback, _Extracted(base.features, np.stack([base.features, *augmented]), row)


@dataclass(frozen=True)
class UnjudgedRows:
    """The readable unjudged sample: split UNJUDGED_SPLIT's rows, and the served model's embedding of them."""

    items: np.ndarray  # per photo its item; the split's rows are these photos as served, then their views
    features: np.ndarray  # (2n, d) backbone features of those rows: the frozen head's inputs
    before: np.ndarray  # (2n, d) the rows embedded by the model the index serves, or by the backbone
    baseline: str  # "served": the index serves the backbone itself; "backbone": it serves another model
    files: list[Path]  # per photo its file
    views: SeededViews  # the split's rows as a fine-tuning run shows them: served, then the cached view


def _unjudged(config: TrainConfig, feedback: Feedback, cache_dir: Path, progress: bool) -> UnjudgedRows:
    """The unjudged sample as served and as the check's view. An index served by the pretrained backbone
    holds its served features already; for one served by another model, whose embedding of the views
    cannot be computed here, the check compares against the untrained backbone instead (``baseline``)."""
    extractor = FeatureExtractor(cache_dir, config.backbone, progress=progress)
    items = list(feedback.unjudged)
    files = [feedback.root / feedback.paths[item] for item in items]
    view = extractor.extract(files, view=EVAL_VIEW, seed=config.seed, augmentation=EVAL_AUGMENTATION)
    served_is_backbone = extractor.embedder.fingerprint == feedback.model_fingerprint
    if served_is_backbone:
        base, ok = np.array([feedback.served[item] for item in items]).reshape(view.features.shape), view.ok
    else:
        extracted = extractor.extract(files)
        base, ok = extracted.features, view.ok & extracted.ok
    features = np.concatenate([base[ok], view.features[ok]]).astype(np.float32)
    positions = np.flatnonzero(ok)  # a view's seed is its photo's place in the list the cache made it from
    return UnjudgedRows(
        np.array(items, dtype=np.int64)[ok],
        features,
        features,
        "served" if served_is_backbone else "backbone",
        [files[k] for k in positions],
        SeededViews(
            np.concatenate([np.full(len(positions), -1), positions]),
            EVAL_VIEW,
            config.seed,
            EVAL_AUGMENTATION,
        ),
    )


def _rows(extracted: _Extracted, items: list[int]) -> np.ndarray:
    return np.array([extracted.row[item] for item in items], dtype=np.int64)


@dataclass(frozen=True)
class JudgedOnlyData:
    """The fields of the trainer's ``PreparedData`` for a run on judgments alone (built there from these)."""

    images: LabelledImages
    indices: dict[str, np.ndarray]
    row_labels: dict[str, np.ndarray]
    features: dict[str, np.ndarray]
    inputs: dict[str, np.ndarray]
    train_views: np.ndarray
    judged: JudgedRows


def judged_only(config: TrainConfig, feedback: Feedback, cache_dir: Path, progress: bool) -> JudgedOnlyData:
    """A run's data on judgments alone (module docstring)."""
    feedback, extracted = _extract(config, feedback, cache_dir, progress)
    items = {name: feedback.items(getattr(feedback, name)) for name in ("train", "val", "test")}
    rows = {name: _rows(extracted, chosen) for name, chosen in items.items()}
    labels = {
        "train": np.full(len(rows["train"]), UNLABELLED, dtype=np.int64),
        **{name: Closure(getattr(feedback, name)).components(items[name]) for name in ("val", "test")},
    }
    every = sorted(extracted.row, key=extracted.row.__getitem__)
    groups = 1 + max(int(labels[name].max(initial=0)) for name in ("val", "test"))
    images = LabelledImages(
        feedback.root,
        tuple(feedback.paths[item] for item in every),
        np.full(len(every), UNLABELLED, dtype=np.int64),
        tuple(f"👍 group {k}" for k in range(groups)),
    )
    unjudged = _unjudged(config, feedback, cache_dir, progress)
    features = {name: extracted.features[rows[name]] for name in rows}
    features[JUDGED_SPLIT] = features["test"]
    features[UNJUDGED_SPLIT] = unjudged.features
    return JudgedOnlyData(
        images=images,
        indices=rows,
        row_labels=labels,
        features=features,
        inputs=features,
        train_views=extracted.views[:, rows["train"]],
        judged=JudgedRows(feedback, np.array(items["train"], dtype=np.int64), 0, items["test"], unjudged),
    )


def with_judged_photos(
    data: PreparedData, config: TrainConfig, feedback: Feedback, cache_dir: Path, progress: bool
) -> PreparedData:
    """A folder's data with the judged photos' rows (module docstring)."""
    feedback, extracted = _extract(config, feedback, cache_dir, progress)
    folder_rows = {path.resolve(): row for row, path in enumerate(data.files("train"))}
    row_items = np.full(len(folder_rows), -1, dtype=np.int64)
    extra: list[int] = []
    for item in feedback.items(feedback.train):
        row = folder_rows.get((feedback.root / feedback.paths[item]).resolve())
        if row is None:
            extra.append(item)
        else:
            row_items[row] = item
    held_out = feedback.items(feedback.test)
    added, judged = _rows(extracted, extra), extracted.features[_rows(extracted, held_out)]
    train = np.concatenate([data.features["train"], extracted.features[added]])
    unjudged = _unjudged(config, feedback, cache_dir, progress)
    evaluated = {"train": train, JUDGED_SPLIT: judged, UNJUDGED_SPLIT: unjudged.features}
    return replace(
        data,
        features={**data.features, **evaluated},
        inputs={**data.inputs, **evaluated},
        train_views=np.concatenate([data.train_views, extracted.views[:, added]], axis=1),
        judged=JudgedRows(
            feedback,
            np.concatenate([row_items, np.array(extra, dtype=np.int64)]),
            len(row_items),
            held_out,
            unjudged,
        ),
    )
