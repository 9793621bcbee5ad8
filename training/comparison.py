"""Proof before promotion: a run's best model against the untrained backbone, on the same images.

* :func:`compare_run` embeds a split (default: the unseen test classes) with both models and computes the
  papers' metrics for each, the paired bootstrap interval on the Recall@1 difference (queries resampled)
  and its verdict; for a Magnet run also the kNC accuracy of Eq. 6.
* :func:`validation_gain`: the same comparison on the validation classes, as the trainer recorded it:
  ``dmlsearch export`` refuses a run that is not *better* than the untrained model there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.model.run_proof import EVAL_FILE
from foundation.atomic import atomic_write_text
from training.bootstrap import DEFAULT_RESAMPLES, Interval, paired_bootstrap
from training.evaluation import EvalSplit, RunEmbeddings, embed_run
from training.label_free_data import is_label_free
from training.losses.magnet import KNCClassifier
from training.metrics import answerable, evaluate, top_hits
from training.run_dir import RunDirectory, RunSummary
from training.samplers import NeighbourhoodSampler
from training.trainer import SELECTION_METRIC, ValidationGain


def knc_accuracy(
    embeddings: np.ndarray, labels: np.ndarray, *, clusters_per_class: int, seed: int = 0
) -> float:
    """Accuracy of Magnet's kNC classifier (Eq. 6) on unit-length embeddings of held-out classes.

    The classes are unseen in training, so each class's items alternate between reference and query: the
    references are clustered per class exactly as the trainer's cluster index does (k-means,
    ``clusters_per_class``), sigma^2 is Eq. 5's variance of the references about their cluster means, and
    each query is classified among all classes' clusters. The same protocol serves both models.
    """
    vectors = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    keep = answerable(labels)
    rank = np.zeros(len(labels), dtype=np.int64)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        rank[members] = np.arange(len(members))
    reference = np.flatnonzero(keep & (rank % 2 == 0))
    queries = np.flatnonzero(keep & (rank % 2 == 1))
    index = NeighbourhoodSampler(
        labels[reference], clusters=1, samples_per_class=1, clusters_per_class=clusters_per_class, seed=seed
    )
    index.refresh(vectors[reference])
    spread = vectors[reference] - index.centres[index.assignment]
    variance = float((spread**2).sum() / max(len(reference) - 1, 1))
    classifier = KNCClassifier(index.centres, index.cluster_labels, max(variance, 1e-12))
    return float(np.mean(classifier.predict(vectors[queries]) == labels[queries]))


@dataclass(frozen=True)
class Comparison:
    """Both models' metrics on one split, the R@1 difference's interval and (Magnet) kNC accuracies."""

    split: str
    images: int
    trained: dict[str, float]
    untrained: dict[str, float]
    recall_at_1: Interval
    knc: dict[str, float] | None
    run: dict[str, Any]

    @property
    def verdict(self) -> str:
        return self.recall_at_1.verdict

    @property
    def learned_nothing(self) -> str | None:
        """Why the run failed (its loss was stuck, the trainer's reason), or None. Its selected checkpoint
        is then step 0, the head training started from: what it changes over the backbone is that head's,
        not training's."""
        failure = self.run.get("failure")
        return failure if isinstance(failure, str) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "images": self.images,
            "verdict": self.verdict,
            "learned_nothing": self.learned_nothing,
            "recall@1_difference": self.recall_at_1.to_dict(),
            "trained": self.trained,
            "untrained": self.untrained,
            "knc_accuracy": self.knc,
            "run": self.run,
        }


def compare_embeddings(
    trained: np.ndarray,
    untrained: np.ndarray,
    labels: np.ndarray,
    *,
    split: str = "test",
    knc_clusters: int | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    run: dict[str, Any] | None = None,
) -> Comparison:
    """Compare two embeddings of the same images (rows paired); ``knc_clusters`` adds kNC accuracy."""
    labels = np.asarray(labels)
    interval = paired_bootstrap(
        top_hits(trained, labels).hit, top_hits(untrained, labels).hit, resamples=resamples, seed=seed
    )
    knc = None
    if knc_clusters is not None:
        knc = {
            name: knc_accuracy(vectors, labels, clusters_per_class=knc_clusters, seed=seed)
            for name, vectors in (("trained", trained), ("untrained", untrained))
        }
    return Comparison(
        split=split,
        images=len(labels),
        trained=evaluate(trained, labels, seed=seed),
        untrained=evaluate(untrained, labels, seed=seed),
        recall_at_1=interval,
        knc=knc,
        run=run or {},
    )


def run_description(run_path: Path, embedded: RunEmbeddings) -> dict[str, Any]:
    """What the comparison is about: the run, its loss, mode and selected step."""
    config = embedded.config
    summary = RunDirectory(run_path).read_summary()
    return {
        "path": str(run_path.resolve()),
        "loss": config.loss,
        "mode": config.mode,
        "backbone": config.backbone,
        "best_step": None if summary is None else summary.best_step,
        "steps": None if summary is None else summary.steps,
        "failure": None if summary is None else summary.failure,
    }


def compare_run(
    run_path: Path,
    data: Path | None = None,
    *,
    split: EvalSplit = "test",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    progress: bool = True,
) -> tuple[Comparison, RunEmbeddings]:
    """Compare a run's best checkpoint with the untrained backbone on ``split`` (rows paired)."""
    embedded = embed_run(run_path, data, split=split, progress=progress)
    config = embedded.config
    comparison = compare_embeddings(
        embedded.trained,
        embedded.untrained,
        embedded.labels,
        split=split,
        knc_clusters=config.clusters_per_class if config.loss == "magnet" else None,
        resamples=resamples,
        seed=seed,
        run=run_description(run_path, embedded),
    )
    return comparison, embedded


def save_comparison(run_path: Path, comparison: Comparison) -> Path:
    path = run_path / EVAL_FILE
    atomic_write_text(path, json.dumps(comparison.to_dict(), indent=2) + "\n")
    return path


def validation_gain(run_path: Path) -> ValidationGain:
    """The selected checkpoint against the untrained backbone on the validation classes: what the trainer
    recorded in summary.json, or, for a run without that record (unfinished, or finished before it was
    kept), the same comparison computed now (the trainer's bootstrap seed, so the two agree)."""
    run = RunDirectory(run_path)
    config = run.require_config()
    summary = run.read_summary()
    if summary is not None and summary.validation_gain is not None:
        return ValidationGain(
            untrained=summary.require_val_backbone()[SELECTION_METRIC],
            trained=summary.val[SELECTION_METRIC],
            best_step=summary.best_step,
            interval=summary.validation_gain,
        )
    best = run.require_best()
    comparison, _ = compare_run(run_path, split="val", seed=config.seed, progress=False)
    return ValidationGain(
        untrained=comparison.untrained[SELECTION_METRIC],
        trained=comparison.trained[SELECTION_METRIC],
        best_step=best.step,
        interval=comparison.recall_at_1,
    )


@dataclass(frozen=True)
class ServingCheck:
    """Whether a run may be served (``dmlsearch export`` without --force), and why."""

    passed: bool
    detail: str
    on_judgments: bool  # the run trained on judgments: their held-out share is (part of) the check
    label_free: bool = False  # the run trained without labels: judged on held-out photos by two checks


def serving_check(run_path: Path) -> ServingCheck:
    """A run is served only where it is better than what it would replace: than the untrained backbone on
    the validation classes (:func:`validation_gain`) for a run on a data folder, and, for a run on
    judgments, on the judgments held out from it (``summary.feedback``, :mod:`training.feedback_gate`);
    a run on judgments alone has the held-out judgments only. A run without labels is judged on held-out
    photos, and where the first check finds it better, the second must agree (training.label_free_data)."""
    run = RunDirectory(run_path)
    config = run.require_config()
    summary = run.read_summary()
    checks: list[tuple[bool, str]] = []
    label_free = config.data is not None and (
        summary.label_free is not None  # a finished run says; an unfinished one needs its folder anyway
        if summary is not None
        else is_label_free(Path(config.data), config.labels)
    )
    if config.data is not None:
        gain = validation_gain(run_path)
        checks.append((gain.improved, gain.describe()))
        if label_free and gain.improved:
            checks.append(_neighbourhood_check(summary))
    if config.feedback is not None:
        if summary is None or summary.feedback is None:
            checks.append((False, "the run has not finished: its held-out judgments are not scored yet"))
        else:
            checks.append((summary.feedback.passed, summary.feedback.describe()))
    return ServingCheck(
        all(ok for ok, _ in checks),
        "; ".join(detail for _, detail in checks),
        config.feedback is not None,
        label_free,
    )


def _neighbourhood_check(summary: RunSummary | None) -> tuple[bool, str]:
    """The label-free gate's second check, as the trainer scored it at the end of the run."""
    if summary is None:
        return False, "the run has not finished: its held-out photos' neighbourhood check is not scored yet"
    if summary.label_free is None or summary.label_free.neighbours is None:
        return False, "the run finished before the gate's neighbourhood check existed: train it again"
    check = summary.label_free.neighbours
    return check.passed, check.describe()
