"""Which loss trains best without labels? Class-fold cross-validation, labels used only to score (issue 39).

``--folds`` disjoint class folds of a labelled folder (``--classes`` classes each, spread over all its
classes; the first ``--per-class`` photos of each). For every loss of ``--methods`` (default: every
registered loss), fold and seed of ``--seeds``: train the label-free recipe (``--labels none``, frozen,
``--steps`` steps: a fixed number, so the machine's load cannot change a result) on the fold's photos, and
score the selected checkpoint by class Recall@1 on the fold's own photos (own-gallery) and on the next
fold's classes (unseen), against the untrained backbone. Each run also records the trainer's gate verdict.
The features are extracted once for every fold's photos and shared by all runs (WORK/cache).

Rows are added to OUT.json as each run ends (a run already there is skipped), so the grid can grow over
several commands (a second seed for the leading losses), and ``--merge`` adds the rows of grids run beside
it (another OUT); OUT.md and OUT.png (the gain per loss across folds) are rewritten from all rows.
``--report`` rewrites them without training.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lib.label_free_cv import CVRow, fold_classes, fold_tables, markdown, merged, plot, run_fold
from lib.label_free_gate import Subset
from lib.options import bench_parser, data_option, out_option, threads_option

from training.data import load_labelled_images
from training.losses import LOSSES


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("labelled image folder (CARS196/images)"),
        out_option(Path("bench/results/label_free_cv"), "results: OUT.md, OUT.json, OUT.png"),
        threads_option(1),
    )
    parser.add_argument("--methods", nargs="+", default=list(LOSSES), help="losses (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--folds", type=int, default=3, help="class folds")
    parser.add_argument("--classes", type=int, default=32, help="classes per fold")
    parser.add_argument("--per-class", type=int, default=16, help="photos per class (first by name)")
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (fixed)")
    parser.add_argument("--every", type=int, default=100, help="steps between the gate's validations")
    parser.add_argument("--work", type=Path, default=Path("runs/label_free_cv"), help="runs and caches")
    parser.add_argument("--report", action="store_true", help="rewrite OUT.md and OUT.png only")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="*",
        default=[],
        help="other records (OUT.json of grids run beside) to add",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = args.data.resolve()
    folds = fold_classes(len(load_labelled_images(data).class_names), args.folds, args.classes)
    record_path = args.out.with_suffix(".json")
    record = json.loads(record_path.read_text()) if record_path.exists() else {"commands": [], "rows": []}
    for other in map(json.loads, (path.read_text() for path in args.merge)):
        record = merged(record, other)
    rows = [CVRow.from_dict(row) for row in record["rows"]]
    if args.merge or not args.report:  # a report alone changes no row
        command = "python bench/label_free_cv.py " + shlex.join(sys.argv[1:])
        record["commands"] = [*record["commands"], command]
    if not args.report:
        every_table, tables = fold_tables(data, folds, args.per_class, args.work)
        subset = Subset.load(every_table, args.work / "cache" / "subset")
        sizes = np.cumsum([0] + [len(load_labelled_images(t)) for t in tables])
        fold_rows = [np.arange(sizes[k], sizes[k + 1]) for k in range(len(tables))]
        done = {(r.method, r.fold, r.seed) for r in rows}
        # Fold by fold: a fold's augmented views are extracted once, by its first run.
        for seed in args.seeds:
            for fold in range(args.folds):
                for method in args.methods:
                    if (method, fold, seed) in done:
                        continue
                    row = run_fold(
                        method,
                        fold,
                        subset,
                        fold_rows,
                        tables,
                        args.work,
                        seed=seed,
                        steps=args.steps,
                        every=args.every,
                    )
                    rows.append(row)
                    print(row, flush=True)
                    record["rows"] = [r.to_dict() for r in rows]
                    write(args.out, record, rows, folds, args.per_class)
    write(args.out, record, rows, folds, args.per_class)
    print(args.out.with_suffix(".md").read_text())


def write(
    out: Path, record: dict[str, Any], rows: list[CVRow], folds: list[list[int]], per_class: int
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({**record, "folds": folds, "per_class": per_class}, indent=2) + "\n"
    )
    if rows:
        out.with_suffix(".md").write_text(markdown(rows, record["commands"], folds, per_class))
        plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
