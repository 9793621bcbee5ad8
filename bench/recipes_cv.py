"""Cross-validate the training recipes over class folds of the Cars196 training classes.

    OMP_NUM_THREADS=1 python bench/recipes_cv.py --data CARS196/images \\
        [--cache-dir ~/.cache/dmlsearch] [--runs-dir ~/.cache/dmlsearch/recipes-cv] [--folds 3] \\
        [--methods almn magnet ...] [--candidates paper recommended ...] [--max-steps N] [--patience N] \\
        [--set views=0 ...] [--report-only]

Recipes are judged on datasets nobody here sees, so they must generalise rather than fit one split. The
98 Cars196 training classes (the test classes 99-196 are never touched) are cut into ``--folds``
contiguous blocks (classes sorted by name, so a fold's makes are mostly unseen in its training). For fold
k, block k is the test set; the other classes train the model, their last 20% held out for checkpoint
selection as usual (``TrainConfig.fold``). Each method trains with each candidate recipe on each fold:

* ``paper``: the values as printed (``--recipe paper``);
* ``recommended``: ``training/recipes.py`` (the default of ``dmlsearch train``);
* any variants in :data:`VARIANTS` (the recommended recipe with some values changed), tried where a
  candidate failed or was marginal.

The table reports each candidate's test Recall@1 per fold against the untrained model on the same fold,
the mean and spread of the gain, and the worst fold. It also reports what a user would serve: the trained
model where validation shows it *better* than the untrained one (the trainer's ``beats_backbone``, the
95% interval of the validation Recall@1 difference above zero), else the untrained model (gain 0), which
``dmlsearch export`` keeps serving. The preferred candidate is the one that helps on every
fold with the highest mean gain, not the one that peaks on one fold. Run directories are resumed. After each
run the table is rebuilt (``--report-only`` just rebuilds it): the finished runs of ``--methods`` replace
their rows in the existing table and the other methods' rows are kept, each row naming the command that
made it; a method's rows of another budget (``--max-steps``, ``--patience``, ``--set``) are dropped, since
they would not compare. Writes ``bench/results/recipes_cv.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
from pathlib import Path

from lib.options import bench_parser, data_option, seed_option
from lib.recipes_cv import (
    METHODS,
    candidates,
    collect,
    fold_config,
    markdown,
    merge,
    run_path,
)

from foundation.atomic import atomic_write_text
from foundation.defaults import CACHE_DIR
from training.config import TrainConfig
from training.trainer import SELECTION_METRIC, train

RESULTS = Path(__file__).parent / "results"
DEFAULT_OUT = RESULTS / "recipes_cv"  # the main table; other budgets go beside it (--out)


def reproducing_command(args: argparse.Namespace) -> str:
    """The command that runs every row this process reports (the parts may have run as several processes)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    words = [*([f"OMP_NUM_THREADS={threads}"] if threads else []), "python", "bench/recipes_cv.py"]
    words += ["--data", str(args.data), "--cache-dir", str(args.cache_dir), "--runs-dir", str(args.runs_dir)]
    if list(args.methods) != list(METHODS):
        words += ["--methods", *args.methods]
    words += ["--folds", str(args.folds), "--seed", str(args.seed)]
    if args.out != DEFAULT_OUT:
        words += ["--out", str(args.out)]
    for flag in ("max_steps", "patience"):
        if getattr(args, flag) is not None:
            words += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return shlex.join(words + (["--set", *args.set] if args.set else []))


def budget_text(args: argparse.Namespace) -> str:
    defaults = TrainConfig.model_fields
    return (
        f"Frozen mode, seed {args.seed}. Budget per run: the candidate recipe's (at most "
        f"{args.max_steps or defaults['max_steps'].default} Adam steps, early stopping after "
        f"{args.patience or defaults['patience'].default} validations without improvement, not before the "
        "recipe's min_steps)"
        f"{'; every candidate also ' + ', '.join(args.set) if args.set else ''}. Validation (checkpoint "
        "selection): the last 20% of each fold's training classes."
    )


def write_report(args: argparse.Namespace) -> str:
    """Rebuild the table: ``args.methods``' finished runs replace their rows in the committed one."""
    path = args.out.with_suffix(".json")
    previous = json.loads(path.read_text()) if path.exists() else {}
    if previous and previous.get("folds") != args.folds:
        previous = {}  # another fold split: nothing compares
    results = merge(previous, collect(args), reproducing_command(args), budget_text(args))
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "folds": args.folds,
        **results,
    }
    table = markdown(results, args.folds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    atomic_write_text(args.out.with_suffix(".md"), table)
    return table


def main() -> None:
    parser = bench_parser(__doc__, data_option("Cars196 images folder"), seed_option())
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="backbone feature cache")
    parser.add_argument("--runs-dir", type=Path, default=CACHE_DIR / "recipes-cv")
    parser.add_argument("--methods", nargs="*", choices=METHODS, default=list(METHODS))
    parser.add_argument("--candidates", nargs="*", help="candidate names to run (default: all)")
    parser.add_argument("--folds", type=int, default=TrainConfig.model_fields["folds"].default)
    parser.add_argument("--only-folds", nargs="*", type=int, help="run only these folds")
    parser.add_argument("--max-steps", type=int, help="override every recipe's step budget")
    parser.add_argument("--patience", type=int, help="override every recipe's early-stopping patience")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="override every candidate, e.g. views=0"
    )
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from finished runs")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="table stem (.md, .json): another one keeps runs of another budget out of the main table",
    )
    args = parser.parse_args()

    if not args.report_only:
        folds = args.only_folds if args.only_folds is not None else range(args.folds)
        for loss in args.methods:  # method by method, so a partial table has whole rows
            for fold in folds:
                for candidate in candidates(loss):
                    if args.candidates and candidate not in args.candidates:
                        continue
                    summary = train(
                        fold_config(args, loss, candidate, fold),
                        run_path(args.runs_dir, candidate, loss, fold),
                        progress=True,
                    )
                    gain = 100 * (summary.test[SELECTION_METRIC] - summary.test_backbone[SELECTION_METRIC])
                    print(f"fold {fold} {loss} {candidate}: R@1 gain {gain:+.2f}", flush=True)
                    write_report(args)
    print(write_report(args))


if __name__ == "__main__":
    main()
