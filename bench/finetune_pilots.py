"""The pilot runs behind the fine-tuning recipe (training/recipes.py FINETUNE), and their validation curves.

    python bench/finetune_pilots.py --data CARS196/images [--runs-dir DIR] [--cache-dir DIR]
                                    [--pilots NAME ...] [--fold 0] [--minutes 30]

Each pilot fine-tunes ``angular`` on a Cars196 class fold of the training classes (``--fold`` k of 3: fold 0
tests on classes 1-33 of 1-98, fold 1 on 34-66, fold 2 on 67-98; its validation classes come from the rest,
as the trainer carves them), changing one setting against the papers' values at a time, for ``--minutes``
of training steps, in ``RUNS_DIR/fold<k>/<pilot>``; a run directory that exists is resumed or, when
finished, only read. Pilots run one process each, so two can share a 2-core machine
(``OMP_NUM_THREADS=1``); compare them at equal steps and at equal minutes. Writes
``bench/results/finetune_pilots.{md,json}``: every validation of every pilot on every fold run (step,
Recall@1), the untrained model at step 0, the fold's test Recall@1 where a pilot finished, and, for pilots
finished on several folds, their per-fold test differences.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from lib.options import bench_parser, data_option

from foundation.atomic import atomic_write_text
from foundation.defaults import CACHE_DIR
from training.backbone import BACKBONES
from training.metrics import evaluate
from training.model import build_objective
from training.recipes import resolve
from training.run_dir import RunDirectory
from training.trainer import prepare_data, train
from training.workloads import FinetuneWorkload, training_preprocessing

RESULTS = Path(__file__).parent / "results"
LOSS = "angular"
# name -> settings over the paper recipe (mode finetune); each differs from another in one setting.
PILOTS: dict[str, dict[str, Any]] = {
    "papers-224": {},
    "papers-160": {"train_size": 160},
    "crop80-160": {"train_size": 160, "min_crop_area": 0.8},
    "crop80-160-backbone0.01": {"train_size": 160, "min_crop_area": 0.8, "backbone_lr_factor": 0.01},
    "frozen-first": {
        "train_size": 160,
        "min_crop_area": 0.8,
        "backbone_lr_factor": 0.01,
        "frozen_first": True,
    },
    # After the frozen stage the head already fits, so the backbone may take a larger rate (LP-FT).
    "frozen-first-backbone0.1": {
        "train_size": 160,
        "min_crop_area": 0.8,
        "backbone_lr_factor": 0.1,
        "frozen_first": True,
    },
}


FOLDS = 3  # the trainer's default class folds of the training classes


def run_pilot(name: str, args: argparse.Namespace) -> Path:
    path = args.runs_dir / f"fold{args.fold}" / name
    # The loss's recommended values (embedding scale) apply; the fine-tuning choices are the pilot's own.
    settings = {
        **resolve(LOSS).settings,
        **PILOTS[name],
        "fold": args.fold,
        "workers": 1,
        "time_budget": 60 * args.minutes,
    }
    settings.pop("mode")
    config = resolve(LOSS, "paper", settings, mode="finetune").config(
        LOSS, str(args.data.resolve()), cache_dir=str(args.cache_dir.resolve()), device="cpu"
    )
    train(config, path, progress=True)
    return path


def curve(path: Path) -> dict[str, Any]:
    run = RunDirectory(path)
    records = run.read_metrics()
    summary = run.read_summary()
    return {
        "validations": [
            {"step": record["step"], "val_recall@1": round(100 * record["val"]["recall@1"], 2)}
            for record in records
        ],
        "test_recall@1": None if summary is None else round(100 * summary.test["recall@1"], 2),
        "test_untrained_recall@1": None
        if summary is None
        else round(100 * summary.test_backbone["recall@1"], 2),
        "train_seconds": None if summary is None else summary.train_seconds,
    }


def eval_sizes(path: Path, sizes: list[int]) -> dict[int, float]:
    """Validation Recall@1 of the pilot's last checkpoint with whole images resized to each of ``sizes``
    (the trainer and the export evaluate at the backbone's input size, 224)."""
    run = RunDirectory(path)
    config = run.require_config()
    data = prepare_data(config, Path(config.cache_dir or path / "cache"), progress=False)
    objective = build_objective(config, data.features["train"].shape[1])
    last = run.load_last()
    if last is None:
        raise SystemExit(f"{path} has no checkpoints/last.pt")
    objective.load_state_dict(last.objective)
    results = {}
    for size in sizes:
        preprocessing = training_preprocessing(BACKBONES[config.backbone].preprocessing, size)
        workload = FinetuneWorkload(
            objective, {"val": data.files("val")}, preprocessing, torch.device("cpu"), workers=1
        )
        results[size] = round(100 * evaluate(workload.embed("val"), data.labels("val"))["recall@1"], 2)
    return results


def fold_differences(curves: dict[int, dict[str, dict[str, Any]]]) -> list[str]:
    """Lines comparing each pair of pilots on the folds where both finished: test R@1 of the second minus
    the first, per fold, and their mean."""
    lines = []
    names = list(PILOTS)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            both = {
                fold: runs[second]["test_recall@1"] - runs[first]["test_recall@1"]
                for fold, runs in sorted(curves.items())
                if all(runs.get(name, {}).get("test_recall@1") is not None for name in (first, second))
            }
            if len(both) > 1:
                per_fold = ", ".join(f"fold {fold}: {gap:+.2f}" for fold, gap in both.items())
                mean = sum(both.values()) / len(both)
                lines.append(f"- {second} minus {first}, test R@1: {per_fold} (mean {mean:+.2f})")
    return lines


def markdown(curves: dict[int, dict[str, dict[str, Any]]], command: str) -> str:
    lines = [
        "# Fine-tuning pilots: angular on Cars196 class folds",
        "",
        f"Command: `{command}`",
        "",
        "Validation Recall@1 (%) on the fold's validation classes after each epoch of training steps; step 0 "
        "is the untrained model. test: the fold's test classes (fold 0: classes 1-33, fold 1: 34-66, fold 2: "
        "67-98), where the pilot ran to its end (- for a pilot stopped by SIGTERM once its first validations "
        "had answered its question, to free the cores).",
        "",
        "| fold | pilot | settings | validations (step: R@1) | test R@1 | untrained test R@1 |",
        "|---|---|---|---|---|---|",
    ]
    for fold, runs in sorted(curves.items()):
        for name, result in runs.items():
            points = ", ".join(f"{v['step']}: {v['val_recall@1']:.2f}" for v in result["validations"])
            settings = (
                ", ".join(f"{key}={value}" for key, value in PILOTS[name].items()) or "the papers' values"
            )
            test = result["test_recall@1"]
            untrained = result["test_untrained_recall@1"]
            lines.append(
                f"| {fold} | {name} | {settings} | {points} | {'-' if test is None else test} | "
                f"{'-' if untrained is None else untrained} |"
            )
    differences = fold_differences(curves)
    if differences:
        lines += ["", "Pilots finished on more than one fold:", "", *differences]
    for fold, runs in sorted(curves.items()):
        for name, result in runs.items():
            if result.get("eval_sizes"):
                sizes = ", ".join(f"{size} px: {r1:.2f}" for size, r1 in result["eval_sizes"].items())
                lines += [
                    "",
                    f"{name} (fold {fold}), its last checkpoint evaluated with whole images at other sizes: "
                    f"{sizes}.",
                ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, data_option("Cars196 images folder"))
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="backbone feature cache")
    parser.add_argument("--runs-dir", type=Path, default=CACHE_DIR / "finetune-pilots")
    parser.add_argument("--pilots", nargs="*", choices=sorted(PILOTS), help="pilots to run (default: all)")
    parser.add_argument("--fold", type=int, choices=range(FOLDS), default=0, help="the class fold to test on")
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of training steps per pilot")
    parser.add_argument("--tabulate", action="store_true", help="only tabulate the runs in --runs-dir")
    parser.add_argument(
        "--eval-sizes",
        nargs="*",
        type=int,
        default=[],
        help="also evaluate papers-160 (fold 0) at these sizes",
    )
    args = parser.parse_args()
    names = args.pilots or list(PILOTS)
    if not args.tabulate:
        for name in names:
            run_pilot(name, args)
    curves = {
        fold: {
            name: curve(args.runs_dir / f"fold{fold}" / name)
            for name in PILOTS
            if (args.runs_dir / f"fold{fold}" / name).exists()
        }
        for fold in range(FOLDS)
    }
    curves = {fold: runs for fold, runs in curves.items() if runs}
    papers_160 = args.runs_dir / "fold0" / "papers-160"
    if args.eval_sizes and papers_160.exists():
        curves[0]["papers-160"]["eval_sizes"] = eval_sizes(papers_160, args.eval_sizes)
    threads = os.environ.get("OMP_NUM_THREADS")
    command = shlex.join([*([f"OMP_NUM_THREADS={threads}"] if threads else []), "python", *sys.argv])
    RESULTS.mkdir(exist_ok=True)
    atomic_write_text(
        RESULTS / "finetune_pilots.json",
        json.dumps(
            {"command": command, "folds": {str(fold): runs for fold, runs in curves.items()}}, indent=2
        ),
    )
    table = markdown(curves, command)
    atomic_write_text(RESULTS / "finetune_pilots.md", table)
    print(table)


if __name__ == "__main__":
    main()
