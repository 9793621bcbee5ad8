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
import statistics
from pathlib import Path
from typing import Any

from foundation.atomic import atomic_write_text
from foundation.defaults import CACHE_DIR
from training.comparison import validation_gain
from training.config import TrainConfig
from training.recipes import DEFAULT_RECIPE, RecipeName, format_values, parse_assignments, recipe, resolve
from training.run_dir import RunDirectory
from training.trainer import SELECTION_METRIC, train

RESULTS = Path(__file__).parent / "results"
DEFAULT_OUT = RESULTS / "recipes_cv"  # the main table; other budgets go beside it (--out)
# The paper methods (ALMN, Magnet, PDDM, Angular, NL&AL, the four LoOp losses) and MS as a baseline.
METHODS = (
    "almn",
    "magnet",
    "pddm",
    "angular",
    "npair-angular",
    "loop-triplet",
    "loop-hphn-triplet",
    "loop-lifted",
    "loop-ms",
    "ms",
)
# Candidate -> (the recipe it starts from, values changed on top), per loss; `paper` and `recommended`
# apply to every loss.
BASE_CANDIDATES: dict[str, tuple[RecipeName, dict[str, Any]]] = {
    "paper": ("paper", {}),
    "recommended": (DEFAULT_RECIPE, {}),
}
VARIANTS: dict[str, dict[str, tuple[RecipeName, dict[str, Any]]]] = {
    "pddm": {  # screened on fold 2 (the hard one); lam1..batch32x4 tried before lam went to 3
        "lam1": ("recommended", {"lam": 1.0}),
        "lr3e-4": ("recommended", {"lam": 1.0, "lr": 3e-4}),
        "lr5e-5": ("recommended", {"lam": 1.0, "lr": 5e-5}),
        "batch32x4": ("recommended", {"lam": 1.0, "classes_per_batch": 32, "samples_per_class": 4}),
        "lam5": ("recommended", {"lam": 5.0}),
        "beta0.4": ("recommended", {"beta": 0.4}),
        "dropout0": ("recommended", {"dropout": 0.0}),
        "per_class": ("recommended", {"quadruplets": "per_class"}),
        "alpha0.3": ("recommended", {"alpha": 0.3}),
        "lam2": ("recommended", {"lam": 2.0}),
        "lam4": ("recommended", {"lam": 4.0}),
        "wd5e-4": ("recommended", {"weight_decay": 5e-4}),  # the paper's gamma (Eq. 4)
        "hidden512": ("recommended", {"hidden": 512}),  # Eq. 2's literal d x d layers at d = 512
        "dim128": ("recommended", {"embedding_dim": 128}),  # the paper's embedding (and unit) width
        "seed1": ("recommended", {"seed": 1}),  # the recipe again with another seed: how much folds move
    },
    "loop-hphn-triplet": {
        "batch16x4": ("recommended", {"classes_per_batch": 16, "samples_per_class": 4}),
    },
}


def candidates(loss: str) -> dict[str, tuple[RecipeName, dict[str, Any]]]:
    return {**BASE_CANDIDATES, **VARIANTS.get(loss, {})}


def run_path(runs_dir: Path, candidate: str, loss: str, fold: int) -> Path:
    return runs_dir / candidate / loss / f"fold{fold}"


def fold_config(args: argparse.Namespace, loss: str, candidate: str, fold: int) -> TrainConfig:
    recipe_name, changes = candidates(loss)[candidate]
    resolved = resolve(loss, recipe_name, {**changes, **budget_overrides(args, loss)})
    return resolved.config(
        loss,
        str(args.data.resolve()),
        fold=fold,
        folds=args.folds,
        cache_dir=str(args.cache_dir.resolve()),
        device="cpu",
        seed=args.seed,
    )


def budget_overrides(args: argparse.Namespace, loss: str) -> dict[str, Any]:
    """What the command line sets over every candidate: the budget flags given and ``--set`` values."""
    given = {key: getattr(args, key) for key in ("max_steps", "patience") if getattr(args, key) is not None}
    return {**given, **parse_assignments(loss, args.set)}


def describe(loss: str, candidate: str, given: list[str]) -> str:
    """The values the candidate sets, with ``--set`` ones (``given``) on top: what the runs trained with."""
    recipe_name, changes = candidates(loss)[candidate]
    values = {key: choice.value for key, choice in recipe(loss, recipe_name).items()}
    values = {**values, **changes, **parse_assignments(loss, given)}
    return format_values(values)


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """``args.methods``' finished runs under ``--runs-dir`` as per-candidate fold results (R@1 in %)."""
    methods: dict[str, Any] = {}
    untrained: dict[str, float] = {}
    for loss in args.methods:
        for candidate in candidates(loss):
            folds = {}
            for fold in range(args.folds):
                path = run_path(args.runs_dir, candidate, loss, fold)
                summary = RunDirectory(path).read_summary()
                if summary is None:
                    continue
                untrained[str(fold)] = round(100 * summary.test_backbone[SELECTION_METRIC], 2)
                gain = round(
                    100 * (summary.test[SELECTION_METRIC] - summary.test_backbone[SELECTION_METRIC]), 2
                )
                validation = validation_gain(path)  # recorded by the trainer, or computed for older runs
                folds[str(fold)] = {
                    "r1": round(100 * summary.test[SELECTION_METRIC], 2),
                    "gain": gain,
                    "val_r1": round(100 * summary.val[SELECTION_METRIC], 2),
                    "validation": validation.interval.verdict,
                    "served_trained": validation.improved,  # export's decision: else the untrained is served
                    "served_gain": gain if validation.improved else 0.0,
                    "best_step": summary.best_step,
                    "steps": summary.steps,
                }
            if folds:
                methods.setdefault(loss, {})[candidate] = {
                    "settings": describe(loss, candidate, args.set),
                    "folds": folds,
                    **spread(folds, args.folds),
                }
    return {"untrained": untrained, "methods": mark_preferred(methods)}


def mark_preferred(methods: dict[str, Any]) -> dict[str, Any]:
    """Flag, per method, the candidate that helps on every fold with the highest mean gain (or, if none
    does, the highest mean gain among the complete ones)."""
    for results in methods.values():
        results_done = {name: r for name, r in results.items() if r["complete"]}
        helping = {name: r for name, r in results_done.items() if r["min_gain"] > 0}
        pool = helping or results_done
        best = max(pool, key=lambda name: pool[name]["mean_gain"]) if pool else None
        for name, result in results.items():
            result["preferred"] = name == best
            result["helps_every_fold"] = result["complete"] and result["min_gain"] > 0
    return methods


def merge(previous: dict[str, Any], current: dict[str, Any], command: str, budget: str) -> dict[str, Any]:
    """The previous table with the rows run now (``current``, tagged with ``command`` and ``budget``)
    replacing theirs: a method run now keeps its previous candidates of the same budget only (others would
    not compare); the other methods' rows stay as they were, with the command that made them."""
    methods: dict[str, Any] = {}
    for loss, by_candidate in previous.get("methods", {}).items():
        for name, result in by_candidate.items():
            tagged = {"command": previous.get("command"), "budget": previous.get("budget"), **result}
            if loss not in current["methods"] or tagged["budget"] == budget:
                methods.setdefault(loss, {})[name] = tagged
    for loss, by_candidate in current["methods"].items():
        for name, result in by_candidate.items():
            methods.setdefault(loss, {})[name] = {**result, "command": command, "budget": budget}
    order = {loss: rank for rank, loss in enumerate(METHODS)}
    methods = {loss: methods[loss] for loss in sorted(methods, key=order.__getitem__)}
    untrained = {**previous.get("untrained", {}), **current["untrained"]}
    return {"untrained": untrained, "methods": mark_preferred(methods)}


def spread(folds: dict[str, dict[str, Any]], count: int) -> dict[str, Any]:
    gains = [fold["gain"] for fold in folds.values()]
    served = [fold["served_gain"] for fold in folds.values() if "served_gain" in fold]
    return {
        "complete": len(folds) == count,
        "mean_gain": round(statistics.fmean(gains), 2),
        "std_gain": round(statistics.stdev(gains), 2) if len(gains) > 1 else 0.0,
        "min_gain": min(gains),
        "range_gain": round(max(gains) - min(gains), 2),
        # What users end up serving, for runs that recorded their validation verdict.
        **(
            {"served_mean_gain": round(statistics.fmean(served), 2), "served_min_gain": min(served)}
            if len(served) == len(gains)
            else {}
        ),
    }


def markdown(results: dict[str, Any], folds: int) -> str:
    untrained = results["untrained"]
    rows = [result for by_candidate in results["methods"].values() for result in by_candidate.values()]
    budgets = {result["command"]: result["budget"] for result in rows}  # in order of first use
    commands = list(budgets)
    fold_cells = [f"fold {k}" for k in range(folds)]
    lines = [
        f"# Recipe cross-validation: {folds} class folds of the Cars196 training classes (1-98)",
        "",
        "Each row comes from the command its `run` column names (runs of one method compare only under "
        "one budget):",
        "",
        *(f"{number}. `{command}`: {budgets[command]}" for number, command in enumerate(commands, 1)),
        "",
        "Each cell: test Recall@1 (%) on the fold's held-out classes, and its gain over the untrained model "
        "on the same fold. mean / std / min / range: of the gain across folds (range = how far it moved). "
        "every fold: the gain is positive on every fold. **preferred**: the candidate that helps on every "
        "fold with the highest mean gain (or, if none does, the highest mean gain). ‡: validation did not "
        "show the trained model better than the untrained one (the 95% interval of the Recall@1 difference "
        "not above zero), so `dmlsearch export` refuses it and the untrained model stays served: a served "
        "gain of 0 on that fold. served mean / min: of the served gain across folds (- for rows run before "
        "it was recorded).",
        "",
        "| method | candidate | "
        + " | ".join(fold_cells)
        + " | mean | std | min | range | every fold | served mean | served min | settings | run |",
        "|" + "---|" * (folds + 11),
        "| untrained | - | "
        + " | ".join(f"{untrained[str(k)]:.2f}" if str(k) in untrained else "" for k in range(folds))
        + " | - | - | - | - | - | - | - | - | - |",
    ]
    for loss, by_candidate in results["methods"].items():
        for name, result in by_candidate.items():
            cells = []
            for k in range(folds):
                fold = result["folds"].get(str(k))
                untrained_served = fold and not fold.get("served_trained", True)
                cells.append(
                    f"{fold['r1']:.2f} ({fold['gain']:+.2f}){' ‡' if untrained_served else ''}"
                    if fold
                    else ""
                )
            label = f"**{name}**" if result["preferred"] else name
            served = [
                f"{result[key]:+.2f}" if key in result else "-"
                for key in ("served_mean_gain", "served_min_gain")
            ]
            lines.append(
                f"| {loss} | {label} | "
                + " | ".join(cells)
                + f" | {result['mean_gain']:+.2f} | {result['std_gain']:.2f} | {result['min_gain']:+.2f} | "
                f"{result['range_gain']:.2f} | {'yes' if result['helps_every_fold'] else 'no'} | "
                f"{' | '.join(served)} | {result['settings']} | {commands.index(result['command']) + 1} |"
            )
    return "\n".join(lines) + "\n"


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="Cars196 images folder")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="backbone feature cache")
    parser.add_argument("--runs-dir", type=Path, default=CACHE_DIR / "recipes-cv")
    parser.add_argument("--methods", nargs="*", choices=METHODS, default=list(METHODS))
    parser.add_argument("--candidates", nargs="*", help="candidate names to run (default: all)")
    parser.add_argument("--folds", type=int, default=TrainConfig.model_fields["folds"].default)
    parser.add_argument("--only-folds", nargs="*", type=int, help="run only these folds")
    parser.add_argument("--max-steps", type=int, help="override every recipe's step budget")
    parser.add_argument("--patience", type=int, help="override every recipe's early-stopping patience")
    parser.add_argument("--seed", type=int, default=0)
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
