"""What bench/recipes_cv.py runs and tabulates: the candidate recipes, each fold's config, and the results
collected from finished runs, merged with earlier ones and written as a table (tested: tests/training)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from training.comparison import validation_gain
from training.config import TrainConfig
from training.recipes import DEFAULT_RECIPE, RecipeName, format_values, parse_assignments, recipe, resolve
from training.run_dir import RunDirectory
from training.trainer import SELECTION_METRIC

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
