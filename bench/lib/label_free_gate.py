"""Does the label-free gate agree with the true change in class retrieval? (issue 39)

A run without labels is judged on held-out photos of its own folder: a checkpoint is kept, and the run
served, only where a label-free check of those photos is *better* than the untrained backbone's by the
paired bootstrap interval (training/trainer.py). Here labels score what the gate cannot see:

* the labelled subset's classes are split in two halves, A and B; a run trains without labels on one
  half's photos (``--labels none``) and is scored by class retrieval on both: on the other half's classes
  (``unseen``) and on its own photos (``own-gallery``): one run, two cases;
* every ``every`` steps the run's weights are read (the run is resumed chunk by chunk, so it trains as
  one run), and each label-free check is computed on the run's held-out validation photos, besides
  class Recall@1 with the labels;
* for each check, the gate is replayed: the checkpoint it selects (its highest score, the earliest of
  ties, as the trainer keeps its best), and its verdict against the untrained backbone's raw features
  (bootstrap on the per-query scores, as the trainer does). The gate *agrees* when it serves a run whose
  selected checkpoint's class Recall@1 is above the untrained backbone's, or refuses one that is not.

The checks (each on the held-out photos, against their own untrained score):

* ``crop``: the trainer's check before this bench: each photo and one training-style view (random
  resized crop of 35-100% of the image, flip) as two rows with the photo's id; Recall@1 over the rows;
* ``strong``: the same with SimCLR's stronger view (crops of 20-100%, colour jitter, grey);
* ``strong-gallery``: the strong view as query against every photo of the folder (held-out and training
  photos as served): is its own photo the nearest?
* ``strong-neighbours``: neighbourhood agreement: the share of a photo's 10 nearest photos of the folder
  that its strong view also has among its 10 nearest (its own photo left out of both).
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from foundation.atomic import atomic_path
from training.bootstrap import paired_bootstrap
from training.config import TrainConfig
from training.data import LabelledImages, load_labelled_images
from training.features import SHARD_SIZE, Augmentation, FeatureExtractor
from training.label_free_data import NEIGHBOURS, label_free_images, plan_label_free
from training.metrics import neighbourhood_agreement, top_hits
from training.model import build_objective
from training.recipes import resolve
from training.run_dir import RunDirectory
from training.trainer import train

CHECKS = ("crop", "strong", "strong-gallery", "strong-neighbours")
TRAINER_GATE = ("crop", "strong-neighbours")  # the checks the trainer's gate asks to agree
TRAINER_CHECK = "crop>strong-neighbours"  # the trainer's gate: crop selects, both must find it better
HALVES = ("A", "B")
VIEW_SEED = 0  # every run's cached views and the checks' views: one extraction shared by all seeds

Embed = Callable[[np.ndarray], np.ndarray]


def subset_table(data: Path, classes: int, per_class: int, out: Path, *, first: int = 0) -> Path:
    """A ``path,label`` table of the first ``per_class`` readable-looking photos (by name) of ``classes``
    classes of the labelled folder ``data``, from its class ``first`` (counted from 0, in name order)."""
    return class_table(load_labelled_images(data), range(first, first + classes), per_class, out)


def class_table(images: LabelledImages, class_ids: Iterable[int], per_class: int, out: Path) -> Path:
    """A ``path,label`` table of the first ``per_class`` photos of each class of ``class_ids``, in order."""
    rows = []
    for label in class_ids:
        members = np.flatnonzero(images.labels == label)[:per_class]
        rows += [(str(images.root / images.paths[i]), images.class_names[label]) for i in members]
    return _write(out, rows)


def _write(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        writer.writerows(rows)
    return path


@dataclass(frozen=True)
class Subset:
    """The labelled subset and its untrained features: served, one crop view, one strong view."""

    images: LabelledImages
    served: np.ndarray
    crop: np.ndarray
    strong: np.ndarray

    @classmethod
    def load(cls, table: Path, cache: Path) -> Subset:
        images = load_labelled_images(table)
        extractor = FeatureExtractor(cache, progress=False)
        files = images.files()
        served = extractor.extract(files)
        if not served.ok.all():
            raise SystemExit(f"unreadable photos in {table}: {served.skipped}; choose other photos")
        return cls(
            images,
            served.features,
            extractor.extract(files, view=1, seed=VIEW_SEED).features,
            extractor.extract(files, view=1, seed=VIEW_SEED, augmentation="strong").features,
        )

    def half(self, name: str) -> np.ndarray:
        """Rows of the photos of half ``name`` of the classes (A: the first half of the class ids)."""
        first = self.labels < len(self.images.class_names) // 2
        return np.flatnonzero(first if name == "A" else ~first)

    @property
    def labels(self) -> np.ndarray:
        return self.images.labels

    def row_of(self, files: list[Path]) -> np.ndarray:
        rows = {path.resolve(): row for row, path in enumerate(self.images.files())}
        return np.array([rows[path.resolve()] for path in files])


def share_cache(subset: Subset, rows: np.ndarray, cache: Path, *, views_only: bool = False) -> None:
    """Store the subset's features of ``rows`` as the cache of a run on those photos (in that order), so
    that the run extracts nothing again: its served features are the subset's (they do not depend on the
    file list); its cached view 1 is the subset's view 1 of each photo, a random crop seeded by the photo's
    place in the subset's list instead of in the run's, as good a view as the one it would have made.
    (The cache is keyed by the list of files: without this every run would extract its photos again, which
    takes most of an hour on a loaded 2-core machine.) ``views_only``: view 1 of both kinds, the held-out
    photos' check view."""
    extractor = FeatureExtractor(cache, progress=False)
    files = subset.images.files(rows)
    kinds: list[tuple[int, Augmentation, np.ndarray]] = [
        (1, "crop", subset.crop),
        (1, "strong", subset.strong),
    ]
    if not views_only:
        kinds = [(0, "crop", subset.served), kinds[0]]
    for view, augmentation, features in kinds:
        directory = cache / "features" / extractor._key(files, view, VIEW_SEED, augmentation)  # its key
        for shard, start in enumerate(range(0, len(files), SHARD_SIZE)):
            path = directory / f"shard-{shard:05d}.npz"
            if path.exists():
                continue
            chunk = features[rows[start : start + SHARD_SIZE]]
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as temporary, temporary.open("wb") as handle:
                np.savez(
                    handle,
                    features=chunk,
                    ok=np.ones(len(chunk), bool),
                    skipped_rows=np.zeros(0, np.int64),
                    skipped_reasons=np.zeros(0, str),
                )


def check_scores(subset: Subset, embed: Embed, held: np.ndarray, folder: np.ndarray) -> dict[str, np.ndarray]:
    """Per held-out photo (or row), each check's score under ``embed``; ``folder``: every photo of the
    run's folder (held-out ones included), the gallery of the gallery checks."""
    ids = np.concatenate([held, held])
    scores = {
        name: top_hits(embed(np.concatenate([subset.served[held], views[held]])), ids).hit.astype(float)
        for name, views in (("crop", subset.crop), ("strong", subset.strong))
    }
    gallery = embed(subset.served[folder])
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries = embed(subset.strong[held])
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    own = np.searchsorted(folder, held)  # folder is sorted
    scores["strong-gallery"] = (np.argmax(queries @ gallery.T, axis=1) == own).astype(float)
    scores["strong-neighbours"] = neighbourhood_agreement(gallery, own, queries, NEIGHBOURS)  # the trainer's
    return scores


def class_recall(subset: Subset, embed: Embed, rows: np.ndarray) -> float:
    return float(top_hits(embed(subset.served[rows]), subset.labels[rows]).hit.mean())


def objective_embed(config: TrainConfig, weights: dict[str, Any], dimension: int) -> Embed:
    """Cached backbone features (``dimension`` wide) to embeddings under a run's objective ``weights``."""
    objective = build_objective(config, dimension)
    objective.load_state_dict(weights)
    objective.eval()

    def embed(features: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return objective.embed(torch.from_numpy(np.ascontiguousarray(features))).numpy()

    return embed


@dataclass(frozen=True)
class Checkpoint:
    step: int
    checks: dict[str, np.ndarray]  # per check: per-query scores on the held-out photos
    recall: dict[str, float]  # per setting: class Recall@1


def train_in_chunks(
    method: str,
    half: str,
    subset: Subset,
    work: Path,
    cache: Path,
    *,
    seed: int,
    steps: int,
    every: int,
    settings: dict[str, Any],
) -> tuple[list[Checkpoint], Checkpoint, int]:
    """Train ``method`` without labels on half ``half``'s photos (``settings``: trainer fields or the
    loss's, over its recipe), reading its weights every ``every`` steps; returns the checkpoints, the
    untrained backbone's scores (as a step -1 checkpoint) and the held-out photos' count."""
    trained_on = subset.half(half)
    other = subset.half("B" if half == "A" else "A")
    table = _write(
        work / f"half-{half}.csv",
        [
            (str(subset.images.files([row])[0]), subset.images.class_names[subset.labels[row]])
            for row in trained_on
        ],
    )
    overrides = {**settings, "patience": 10**6, "eval_every": every, "view_seed": VIEW_SEED}
    config = resolve(method, overrides=overrides, label_free=True).config(
        method, str(table), labels="none", seed=seed, cache_dir=str(cache)
    )
    loose = label_free_images(table, "none")
    assert loose is not None
    share_cache(subset, subset.row_of(loose.files()), cache)
    plan = plan_label_free(loose, seed=seed)
    held_out = np.sort(np.concatenate([plan.val, plan.test]))  # the trainer's held-out view's list
    share_cache(subset, subset.row_of(loose.files(held_out)), cache, views_only=True)
    held = subset.row_of(plan.images.files(plan.val))
    folder = np.sort(subset.row_of(plan.images.files(np.concatenate([plan.train, plan.val]))))
    settings = {"unseen": other, "own-gallery": trained_on}

    def scored(step: int, embed: Embed) -> Checkpoint:
        recall = {name: class_recall(subset, embed, rows) for name, rows in settings.items()}
        return Checkpoint(step, check_scores(subset, embed, held, folder), recall)

    run = work / f"{method}-half{half}-seed{seed}"
    checkpoints = []
    for target in range(0, steps + 1, every):
        train(config.model_copy(update={"max_steps": target}), run, progress=False)
        last = RunDirectory(run).require_last()
        checkpoints.append(
            scored(last.progress.step, objective_embed(config, last.objective, subset.served.shape[1]))
        )
        if last.progress.stopped:
            break
    return checkpoints, scored(-1, lambda features: features.copy()), len(held)


@dataclass(frozen=True)
class Verdict:
    """One case (a run scored in one setting) judged by one check."""

    method: str
    half: str
    setting: str
    seed: int
    check: str
    held_out: int
    selected_step: int
    check_untrained: float
    check_selected: float
    low: float
    high: float
    served: bool
    recall_selected: float
    recall_untrained: float
    recall_best: float  # the highest class Recall@1 of any read checkpoint (what an oracle would keep)
    gain: float
    agrees: bool


def replay(
    method: str, half: str, seed: int, checkpoints: list[Checkpoint], untrained: Checkpoint, held_out: int
) -> list[Verdict]:
    """Each check's gate replayed on the checkpoints, in both settings; and the trainer's gate
    (:data:`TRAINER_CHECK`): the checkpoint ``crop`` selects, served only where both checks of
    :data:`TRAINER_GATE` find it better (its row shows the second check's scores)."""
    gates = [(check, check, (check,)) for check in CHECKS] + [(TRAINER_CHECK, "crop", TRAINER_GATE)]
    verdicts = []
    for name, selecting, judging in gates:
        means = [float(point.checks[selecting].mean()) for point in checkpoints]
        selected = checkpoints[int(np.argmax(means))]  # the first of equal highs, as the trainer keeps
        intervals = [
            paired_bootstrap(selected.checks[check], untrained.checks[check], seed=seed) for check in judging
        ]
        served = selected.step > 0 and all(interval.verdict == "better" for interval in intervals)
        interval, shown = intervals[-1], judging[-1]
        for setting in ("unseen", "own-gallery"):
            gain = selected.recall[setting] - untrained.recall[setting]
            verdicts.append(
                Verdict(
                    method=method,
                    half=half,
                    setting=setting,
                    seed=seed,
                    check=name,
                    held_out=held_out,
                    selected_step=selected.step,
                    check_untrained=round(100 * float(untrained.checks[shown].mean()), 2),
                    check_selected=round(100 * float(selected.checks[shown].mean()), 2),
                    low=round(100 * interval.low, 2),
                    high=round(100 * interval.high, 2),
                    served=served,
                    recall_selected=round(100 * selected.recall[setting], 2),
                    recall_untrained=round(100 * untrained.recall[setting], 2),
                    recall_best=round(100 * max(point.recall[setting] for point in checkpoints), 2),
                    gain=round(100 * gain, 2),
                    agrees=served == (gain > 0),
                )
            )
    return verdicts


def both(verdicts: list[Verdict], first: str, second: str) -> list[Verdict]:
    """The gate of two checks together, replayed from their verdicts: ``second`` selects the checkpoint,
    and the run is served only where both checks served it and selected that same checkpoint (where they
    selected different ones, the verdicts do not say whether ``first`` finds ``second``'s checkpoint
    better, and the stricter reading refuses it)."""
    by_case = {(v.method, v.half, v.setting, v.seed, v.check): v for v in verdicts}
    combined = []
    for v in verdicts:
        if v.check != second:
            continue
        other = by_case[(v.method, v.half, v.setting, v.seed, first)]
        served = v.served and other.served and other.selected_step == v.selected_step
        combined.append(replace(v, check=f"{first}+{second}", served=served, agrees=served == (v.gain > 0)))
    return combined


def summary_rows(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    """Per check: cases, agreement rate, runs served, served below untrained, mean gain when served."""
    rows = []
    for check in dict.fromkeys(v.check for v in verdicts):
        mine = [v for v in verdicts if v.check == check]
        served = [v for v in mine if v.served]
        rows.append(
            {
                "check": check,
                "cases": len(mine),
                "agreement": round(100 * float(np.mean([v.agrees for v in mine])), 1) if mine else None,
                "served": len(served),
                "true_gain_positive": sum(v.gain > 0 for v in mine),
                "served_below_untrained": sum(v.gain < 0 for v in served),
                "mean_gain_served": round(float(np.mean([v.gain for v in served])), 2) if served else None,
            }
        )
    return rows


def markdown(verdicts: list[Verdict], command: str, notes: str) -> str:
    lines = [
        "# The label-free gate against the true change in class Recall@1 (issue 39)",
        "",
        f"`{command}`",
        "",
    ]
    lines += [notes, "", "## Agreement per check", ""]
    lines += [
        "| check | cases | agreement % | served | true gain > 0 | served below untrained | "
        "mean gain served |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary_rows(verdicts):
        mean = "-" if row["mean_gain_served"] is None else f"{row['mean_gain_served']:+.2f}"
        lines.append(
            f"| {row['check']} | {row['cases']} | {row['agreement']} | {row['served']} | "
            f"{row['true_gain_positive']} | {row['served_below_untrained']} | {mean} |"
        )
    lines += [
        "",
        "## Every case",
        "",
        "| check | method | half | setting | seed | held out | step | check untrained | check selected | "
        "interval | served | R@1 selected | R@1 untrained | R@1 best read | gain | agrees |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {v.check} | {v.method} | {v.half} | {v.setting} | {v.seed} | {v.held_out} | {v.selected_step} | "
        f"{v.check_untrained:.2f} | {v.check_selected:.2f} | [{v.low:+.2f}, {v.high:+.2f}] | "
        f"{'yes' if v.served else 'no'} | {v.recall_selected:.2f} | {v.recall_untrained:.2f} | "
        f"{v.recall_best:.2f} | {v.gain:+.2f} | {'yes' if v.agrees else 'no'} |"
        for v in sorted(verdicts, key=lambda v: (v.check, v.method, v.setting, v.half, v.seed))
    ]
    return "\n".join(lines) + "\n"


def to_dicts(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    return [asdict(v) for v in verdicts]
