"""Label-free training measured against labels (issue 39): train without labels, score with them.

Two settings, on a labelled folder whose classes are split as in the papers (first half, second half):

* ``unseen``: train on the first half's photos with their labels removed (``--labels none``), test class
  retrieval on the second half's classes, as every table here does;
* ``own-gallery``: train without labels on the second half's photos themselves and search those same
  photos (transductive: what a user does with their own folder).

A row gives the run's gate-selected checkpoint's Recall@1 on the test photos with their labels, the
untrained backbone's, the gain, the minutes the run took (feature extraction included), the seed, and
whether the label-free gate would serve it (``served``). Tested: tests/training/test_label_free_bench.py.
"""

from __future__ import annotations

import csv
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.budget import plan_for
from training.comparison import compare_run
from training.data import load_labelled_images, split_classes
from training.recipes import resolve
from training.trainer import train

SETTINGS = ("unseen", "own-gallery")


@dataclass(frozen=True)
class Row:
    method: str
    setting: str
    recall_at_1: float
    untrained: float
    gain: float
    minutes: float
    seed: int
    served: bool  # the label-free gate's verdict: `dmlsearch export` would take it

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["recall@1"] = row.pop("recall_at_1")
        return row


def write_csv(path: Path, root: Path, paths: list[str], labels: list[str]) -> Path:
    """A ``path,label`` table of ``paths`` (relative to ``root``) that a run reads without labels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        writer.writerows([str((root / p).resolve()), label] for p, label in zip(paths, labels, strict=True))
    return path


def setting_data(data: Path, setting: str, work: Path) -> Path:
    """What a run trains on in ``setting``: a table of the first (unseen) or second (own-gallery) half's
    photos. Either way it is scored on the second half's classes of ``data``, with their labels."""
    images = load_labelled_images(data)
    test = split_classes(images).test
    halves = {"own-gallery": test, "unseen": np.setdiff1d(np.arange(len(images)), test)}
    chosen = halves[setting]
    names = [images.class_names[images.labels[i]] for i in chosen]
    return write_csv(work / f"{setting}.csv", images.root, [images.paths[i] for i in chosen], names)


def run_setting(
    method: str,
    setting: str,
    data: Path,
    work: Path,
    *,
    seed: int,
    cache: Path | None = None,
    trained_on: Path | None = None,
    name: str = "",
    **settings: Any,
) -> Row:
    """Train ``method`` without labels in ``setting`` (``settings``: trainer fields or the loss's, e.g.
    max_steps; ``mode="auto"`` with a ``time_budget`` in seconds picks the mode as ``dmlsearch train`` does
    on a CPU without ``--mode``) and score its selected checkpoint with the labels; ``cache``: the feature
    cache (default: under ``work``); ``trained_on``: the table to train on instead of the setting's
    (bench/label_free_copies.py adds edited copies to it); ``name``: added to the run's folder."""
    trained_on = trained_on or setting_data(data, setting, work)
    fields: dict[str, Any] = {"labels": "none", "seed": seed, "cache_dir": str(cache or work / "cache")}
    mode = settings.pop("mode", "frozen")
    if mode == "auto":  # as `dmlsearch train` without --mode on a CPU: fine-tune if enough steps fit
        finetune = resolve(method, overrides=settings, mode="finetune", label_free=True)
        plan = plan_for(finetune.config(method, str(trained_on), **fields), settings["time_budget"])
        print(plan.reason, flush=True)
        mode = plan.mode
        if mode == "finetune":
            settings["max_steps"] = plan.max_steps
    resolved = resolve(method, overrides=settings, mode=mode, label_free=True)
    config = resolved.config(method, str(trained_on), **fields)
    run = work / f"{method}-{setting}{name}-seed{seed}"
    started = time.perf_counter()
    summary = train(config, run, progress=False)
    minutes = (time.perf_counter() - started) / 60
    comparison, _ = compare_run(run, data, split="test", seed=seed, progress=False)
    trained, untrained = comparison.trained["recall@1"], comparison.untrained["recall@1"]
    return Row(
        method=method,
        setting=setting,
        recall_at_1=round(100 * trained, 2),
        untrained=round(100 * untrained, 2),
        gain=round(100 * (trained - untrained), 2),
        minutes=round(minutes, 1),
        seed=seed,
        served=bool(summary.beats_backbone),
    )


def markdown(rows: list[Row], command: str) -> str:
    lines = [
        "# Training without labels (issue 39)",
        "",
        f"`{command}`",
        "",
        "| method | setting | recall@1 | untrained | gain | minutes | seed | served by the gate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.method} | {r.setting} | {r.recall_at_1:.2f} | {r.untrained:.2f} | {r.gain:+.2f} | "
        f"{r.minutes:.1f} | {r.seed} | {'yes' if r.served else 'no'} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"
