"""Does a check of class structure kept refuse the label-free runs that lost it? (issue 39, gate3)

Replays the class-fold runs of bench/label_free_cv.py (``--record``: its OUT.json; ``--work``: its WORK,
the runs and the shared feature caches; nothing there is written): for each run, its selected checkpoint
and the untrained backbone embed the run's folder (the fold's photos, no labels), and the candidates of
bench/lib/label_free_retention.py score what the checkpoint kept. A floor on each candidate is added to
the trainer's gate, chosen by leave-one-fold-out, and the gate is counted on each held-out fold with the
true class Recall@1 change of bench/label_free_cv.py (labels used only to score). OUT.md and OUT.json.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from lib.label_free_cv import CVRow
from lib.label_free_gate import Subset, objective_embed
from lib.label_free_retention import (
    BAND_TIES,
    CANDIDATES,
    OBJECTIVES,
    Scored,
    band_leave_one_fold_out,
    leave_one_fold_out,
    score_run,
    tally,
)
from lib.options import bench_parser, data_option, out_option, threads_option

from training.config import TrainConfig
from training.data import load_labelled_images
from training.run_dir import RunDirectory


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("labelled image folder (CARS196/images), as bench/label_free_cv.py had it"),
        out_option(Path("bench/results/label_free_gate_retention"), "results: OUT.md, OUT.json"),
        threads_option(1),
    )
    parser.add_argument("--record", type=Path, default=Path("bench/results/label_free_cv.json"))
    parser.add_argument("--work", type=Path, required=True, help="bench/label_free_cv.py's WORK")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    record = json.loads(args.record.read_text())
    rows = [CVRow.from_dict(row) for row in record["rows"]]
    folds = record["folds"]
    tables = [args.work / f"fold{k}.csv" for k in range(len(folds))]  # written by bench/label_free_cv.py
    subset = Subset.load(args.work / "folds.csv", args.work / "cache" / "subset")
    sizes = np.cumsum([0] + [len(load_labelled_images(t)) for t in tables])
    runs = []
    for row in sorted(rows, key=lambda r: (r.method, r.fold, r.seed)):
        photos = np.arange(sizes[row.fold], sizes[row.fold + 1])
        run = RunDirectory(args.work / "runs" / f"{row.method}-fold{row.fold}-seed{row.seed}")
        config = TrainConfig.model_validate_json((run.path / "config.json").read_text())
        embed = objective_embed(config, run.require_best().objective, subset.served.shape[1])
        untrained = subset.served[photos]
        runs.append(score_run(row, untrained, embed(untrained), subset.labels[photos]))
        print(row.method, row.fold, row.seed, runs[-1].scores, flush=True)
    command = "python bench/label_free_gate_retention.py " + shlex.join(sys.argv[1:])
    result = {
        "command": command,
        "runs": [run.to_dict() for run in runs],
        "gate_now": tally(runs, None, 0.0),
        "leave_one_fold_out": [
            entry for c in CANDIDATES for o in OBJECTIVES for entry in leave_one_fold_out(runs, c, o)
        ],
        "band_leave_one_fold_out": [
            entry for ties in BAND_TIES for entry in band_leave_one_fold_out(runs, ties)
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result, runs))
    print(args.out.with_suffix(".md").read_text())


def markdown(result: dict[str, Any], runs: list[Scored]) -> str:
    lines = ["# A label-free check of class structure kept, added to the gate (issue 39)", ""]
    lines += [f"`{result['command']}`", "", (__doc__ or "").strip().split("\n\n")[1].replace("\n", " "), ""]
    lines += ["## The gate as it is, on all runs", "", f"{result['gate_now']}", ""]
    lines += ["## Leave one fold out: floor chosen on the other two folds, counted on the held-out fold", ""]
    lines += [
        "| candidate | objective | held-out fold | floor | gate | runs served | cases served gained | served "
        "below untrained | worst served | refused gained | agreement % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["leave_one_fold_out"]:
        for name in ("gate_now", "with_floor"):
            t = entry[name]
            lines.append(
                f"| {entry['candidate']} | {entry['objective']} | {entry['held_out_fold']} | "
                f"{entry['floor']:.4f} | {name} | "
                f"{t['runs_served']} | {t['served_gained']} | {t['served_below_untrained']} | "
                f"{t['worst_served']} | {t['refused_gained']} | {t['agreement']} |"
            )
    lines += ["", "## Leave one fold out: a band, retention@1 >= floor and overlap@10 <= ceiling", ""]
    lines += [
        "Its form was picked after looking at every run's scores: weaker evidence than the floors above. "
        "Of equally good bands on the two folds, loose: the lowest floor, then the highest ceiling; tight: "
        "the highest floor, then the lowest ceiling.",
        "",
        "| ties | held-out fold | floor | ceiling | gate | runs served | cases served gained | served below "
        "untrained | worst served | refused gained | agreement % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["band_leave_one_fold_out"]:
        for name in ("gate_now", "with_band"):
            t = entry[name]
            lines.append(
                f"| {entry['ties']} | {entry['held_out_fold']} | {entry['floor']:.4f} | "
                f"{entry['ceiling']:.4f} | {name} | "
                f"{t['runs_served']} | {t['served_gained']} | {t['served_below_untrained']} | "
                f"{t['worst_served']} | {t['refused_gained']} | {t['agreement']} |"
            )
    lines += ["", "## Every run", ""]
    lines += [
        "| loss | fold | seed | gate served | own gain | unseen gain | "
        + " | ".join(f"{c} [interval]" for c in CANDIDATES)
        + " | confident pairs | of one class |",
        "|---|---|---|---|---|---|" + "---|" * len(CANDIDATES) + "---|---|",
    ]
    for run in runs:
        r = run.row
        cells = [
            f"{run.scores[c]:.3f} [{run.intervals[c][0]:.3f}, {run.intervals[c][1]:.3f}]" for c in CANDIDATES
        ]
        served = "yes" if r.served else "no"
        lines.append(
            f"| {r.method} | {r.fold} | {r.seed} | {served} | {r.gain('own-gallery'):+.2f} | "
            f"{r.gain('unseen'):+.2f} | {' | '.join(cells)} | {run.pairs} | {run.pairs_one_class:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
