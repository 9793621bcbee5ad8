"""Train every registered loss on Cars196 with the same budget and tabulate the results.

    OMP_NUM_THREADS=1 python bench/train_all.py --data CARS196/images \\
        [--mode frozen|partial|finetune] [--time-budget MIN] \\
        [--cache-dir ~/.cache/dmlsearch] [--runs-dir ~/.cache/dmlsearch/bench-runs] \\
        [--methods almn magnet ...] [--recipe recommended|paper] [--max-steps N] [--patience N] [--seed 0] \\
        [--set views=2 ...] [--device cpu|cuda] [--results-dir bench/results]

``--mode frozen`` trains the head on cached pooled features; ``--mode partial`` also trains the backbone's
last stage on cached maps entering it (about 0.6 s a 128-image step on one core instead of milliseconds,
so it is meant for a few ``--methods``); ``--mode finetune`` trains the whole network on augmented images
(minutes per epoch on a CPU: give ``--time-budget`` and run it without OMP_NUM_THREADS=1).

(One torch thread: on a small shared CPU the head's tiny matrix products run several times faster than
with OpenMP threads competing for the cores.)

Protocol (all five papers): train on classes 1-98, evaluate retrieval on the unseen classes 99-196 (query =
every test image, gallery = the other test images); checkpoints are selected on the last 20% of the
*training* classes (79-98), held out for validation. Every method trains the same PCA-initialised residual
head on the same cached EfficientNet-Lite0 features (plus augmented views), with Adam, the same learning rate
and step budget, and early stopping on validation Recall@1. The first row is the pretrained backbone with no
training; the peers are pytorch-metric-learning's MultiSimilarityLoss (+ its miner) and AngularLoss trained
the same way. Every row trains with its loss's recipe from ``training/recipes.py`` (the one source of truth
that ``dmlsearch train`` uses too; ``--recipe paper`` for the values as printed); the table's last column
lists what the recipe set.

Backbone features are extracted once into ``--cache-dir`` (minutes on a CPU) and reused by every run;
each run directory under ``--runs-dir`` is resumed rather than retrained when it exists.
Writes ``bench/results/train_all.{md,json}`` (or under ``--results-dir``) after every row (partial adds
``_partial``, the paper recipe ``_paper``, ``--device cuda`` ``_gpu``, a seed other than 0 ``_seed{N}``);
the rows run replace those of the same method in an existing table made with the same budget, and the
others are kept. ``--collect`` tabulates every run table of ``--mode`` found there (``{stem}_*.json``, each
run's table copied in under a name of its own) into the mode's main table, one row per method and run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from lib.options import bench_parser, data_option, seed_option
from lib.train_all import (
    all_methods,
    register_peers,
    run_method,
)

from foundation.atomic import atomic_write_text
from foundation.defaults import CACHE_DIR
from training.config import TrainConfig
from training.recipes import (
    DEFAULT_RECIPE,
    RECIPE_NAMES,
)

RESULTS = Path(__file__).parent / "results"
STAGE_LR = {
    "frozen": "",
    "partial": "; the backbone's last stage at 1e-5",
    "finetune": "; the whole backbone at 1e-5",
}
# The frozen recipes' seeds (train_all_seeds.md): what a fine-tuned run is compared with.
FROZEN_SEEDS = (0, 1, 2)
METRICS = ("recall@1", "recall@2", "recall@4", "recall@8", "nmi", "f1", "map@r")


def percent(metrics: dict[str, float]) -> dict[str, float]:
    return {name: round(100 * metrics[name], 2) for name in METRICS}


def markdown(
    rows: list[dict[str, Any]],
    baseline: dict[str, float],
    command: str,
    budget: str,
    mode: str,
    machine: str,
) -> str:
    header = "| method | " + " | ".join(METRICS) + " | best step | validation | train s | wall s | settings |"
    note = (
        "best step: the step selected on validation (0 = the untrained PCA head kept); validation: the "
        "selected model against the untrained backbone on the validation classes, the paired bootstrap "
        "verdict on the Recall@1 difference (only `better` is exported without --force; - for rows run "
        "before it was recorded); train s: seconds in training steps, validation excluded; wall s: the "
        "whole run (validation and test included, the feature cache already filled; - where not recorded)."
    )
    lines = [
        f"# {mode.capitalize()}-mode training on Cars196 (unseen classes 99-196)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine}.",
        "",
        budget,
        "",
        note,
        "",
        header,
        "|" + "---|" * (len(METRICS) + 6),
        "| pretrained, no training | "
        + " | ".join(f"{v:.2f}" for v in baseline.values())
        + " | - | - | - | - | - |",
    ]
    for row in rows:
        cells = [row["method"], *(f"{v:.2f}" for v in row["test"].values())]
        verdict = row.get("validation_gain", {}).get("verdict", "-")
        wall = row.get("wall_seconds")
        cells += [
            str(row["best_step"]),
            verdict,
            f"{row['train_seconds']:.0f}",
            "-" if wall is None else str(wall),
            row["settings"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def merged_rows(
    previous: dict[str, Any], rows: list[dict[str, Any]], budget: str, order: list[str]
) -> list[dict[str, Any]]:
    """The previous table's rows (same budget only) with ``rows`` replacing theirs, in method order."""
    by_method = {row["method"]: row for row in previous["rows"]} if previous["budget"] == budget else {}
    by_method.update({row["method"]: row for row in rows})
    return sorted(by_method.values(), key=lambda row: order.index(row["method"]))


def table_stem(mode: str, recipe_name: str, seed: int, device: str = "cpu") -> str:
    """Other modes, recipes, seeds and devices get tables of their own, so a study never mixes into the main
    table."""
    stem = "train_all" + ("" if mode == "frozen" else f"_{mode}")
    stem += "" if recipe_name == DEFAULT_RECIPE else f"_{recipe_name}"
    stem += "" if device == "cpu" else "_gpu"
    return stem + (f"_seed{seed}" if seed else "")


def machine_text(device: str) -> str:
    """The machine a table was measured on; GPU tables name the GPU."""
    cpu = f"{platform.machine()}, {torch.get_num_threads()} torch threads"
    return f"{torch.cuda.get_device_name()}; {cpu}" if device == "cuda" else cpu


def budget_text(args: argparse.Namespace) -> str:
    defaults = TrainConfig.model_fields
    max_steps = args.max_steps or defaults["max_steps"].default
    patience = args.patience or defaults["patience"].default
    minutes = f", at most {args.time_budget:g} minutes of steps" if args.time_budget is not None else ""
    return (
        f"Budget per method: at most {max_steps} Adam steps{minutes} (lr {defaults['lr'].default}"
        f"{STAGE_LR[args.mode]} unless the recipe sets it), validation every epoch, early stopping after "
        f"{patience} validations without improvement (not before the recipe's min_steps); each loss's "
        f"{args.recipe} recipe (training/recipes.py; its values in the settings column)"
        f"{'; every row also ' + ', '.join(args.set) if args.set else ''}; seed {args.seed}. "
        "Metrics in %, test = unseen classes."
    )


def write_table(args: argparse.Namespace, rows: list[dict[str, Any]], baseline: dict[str, float]) -> str:
    """Write the table (merged with the existing one when only some ``--methods`` ran); after every row."""
    threads = os.environ.get("OMP_NUM_THREADS")
    command = shlex.join([*([f"OMP_NUM_THREADS={threads}"] if threads else []), "python", *sys.argv])
    budget = budget_text(args)
    stem = table_stem(args.mode, args.recipe, args.seed, args.device)
    previous = args.results_dir / f"{stem}.json"
    if previous.exists():
        rows = merged_rows(json.loads(previous.read_text()), rows, budget, [m.label for m in all_methods()])
    report = {
        "command": command,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_text(args.device),
        "budget": budget,
        "pretrained": baseline,
        "rows": rows,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, baseline, command, budget, args.mode, report["machine"])
    atomic_write_text(args.results_dir / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(args.results_dir / f"{stem}.md", table)
    return table


def seeds_table(args: argparse.Namespace) -> str:
    """``--mean-of-seeds``: Recall@1 per method averaged over the per-seed tables (no training)."""
    tables = {}
    for seed in args.mean_of_seeds:
        path = args.results_dir / f"{table_stem(args.mode, args.recipe, seed, args.device)}.json"
        if path.exists():
            tables[seed] = json.loads(path.read_text())
    untrained = statistics.fmean(table["pretrained"]["recall@1"] for table in tables.values())
    lines = [
        f"# {args.mode.capitalize()}-mode Recall@1 on Cars196 unseen classes 99-196, over seeds "
        f"{', '.join(map(str, tables))}",
        "",
        f"Command: `python bench/train_all.py --mean-of-seeds {' '.join(map(str, args.mean_of_seeds))}` "
        "(averages the per-seed tables below; no training).",
        "",
        *(f"- seed {seed}: `{table['command']}` ({table['budget']})" for seed, table in tables.items()),
        "",
        f"Untrained: {untrained:.2f}. gain: mean over the seeds run minus untrained; min: the worst seed's "
        "gain. served min: the worst seed's gain of the model a user ends up serving: the trained one where "
        "validation showed it better than the untrained backbone, else the untrained one (gain 0; - where a "
        "seed's table predates the record). settings: as each seed's table lists them (flagged when seeds "
        "differ).",
        "",
        "| method | "
        + " | ".join(f"seed {seed}" for seed in tables)
        + " | seeds | mean | gain | min | served min | settings |",
        "|" + "---|" * (len(tables) + 7),
    ]
    for method in all_methods():
        rows = {seed: row for seed, t in tables.items() for row in t["rows"] if row["method"] == method.label}
        if not rows:
            continue
        scores = {seed: row["test"]["recall@1"] for seed, row in rows.items()}
        gains = [score - tables[seed]["pretrained"]["recall@1"] for seed, score in scores.items()]
        recorded = all("validation_gain" in row for row in rows.values())
        # run_method's beats_backbone is export's decision: the trained model is served only where it holds.
        served = [
            gain if row["beats_backbone"] else 0.0 for gain, row in zip(gains, rows.values(), strict=True)
        ]
        settings = {row["settings"] for row in rows.values()}
        cells = [f"{scores[seed]:.2f}" if seed in scores else "" for seed in tables]
        mean = statistics.fmean(scores.values())
        lines.append(
            f"| {method.label} | {' | '.join(cells)} | {len(scores)} | {mean:.2f} | "
            f"{statistics.fmean(gains):+.2f} | {min(gains):+.2f} | "
            f"{f'{min(served):+.2f}' if recorded else '-'} | "
            f"{settings.pop() if len(settings) == 1 else 'differs: ' + ' / '.join(sorted(settings))} |"
        )
    table = "\n".join(lines) + "\n"
    stem = table_stem(args.mode, args.recipe, 0, args.device) + "_seeds"
    atomic_write_text(args.results_dir / f"{stem}.md", table)
    return table


def collected_stem(mode: str) -> str:
    """The table of every run of a mode (``--collect``): the name a seed-0 run of the default recipe would
    have, so a run's own table must be written elsewhere and copied in under a name of its own."""
    return table_stem(mode, DEFAULT_RECIPE, 0)


def frozen_means(results_dir: Path) -> dict[str, float]:
    """Each method's frozen-mode test Recall@1 averaged over :data:`FROZEN_SEEDS` (the seeds whose tables
    are there)."""
    scores: dict[str, list[float]] = {}
    for seed in FROZEN_SEEDS:
        path = results_dir / f"{table_stem('frozen', DEFAULT_RECIPE, seed)}.json"
        if path.exists():
            for row in json.loads(path.read_text())["rows"]:
                scores.setdefault(row["method"], []).append(row["test"]["recall@1"])
    return {method: round(statistics.fmean(values), 2) for method, values in scores.items()}


def collect_runs(args: argparse.Namespace) -> str:
    """``--collect``: one row per method of every ``{mode}`` run table in ``--results-dir`` (no training)."""
    stem = collected_stem(args.mode)
    frozen = frozen_means(args.results_dir)
    rows = []
    for path in sorted(args.results_dir.glob(f"{stem}_*.json")):
        table = json.loads(path.read_text())
        if "rows" not in table:
            continue
        words = shlex.split(table["command"])
        seed = int(words[words.index("--seed") + 1]) if "--seed" in words else 0
        for row in table["rows"]:
            rows.append(
                {
                    "method": row["method"],
                    **{name: row["test"][name] for name in METRICS},
                    "untrained_recall@1": table["pretrained"]["recall@1"],
                    "frozen_mean_recall@1": frozen.get(row["method"]),
                    "seed": seed,
                    "machine": table["machine"],
                    "steps": row["steps"],
                    "best_step": row["best_step"],
                    "train_seconds": row["train_seconds"],
                    "wall_seconds": row.get("wall_seconds"),
                    "settings": row["settings"],
                    "budget": table["budget"],
                    "command": table["command"],
                    "table": path.with_suffix(".md").name,
                }
            )
    command = f"python bench/train_all.py --mode {args.mode} --collect"
    lines = [
        f"# Every {args.mode}-mode run, one row per method and table",
        "",
        f"Command: `{command}` (no training: reads every `{stem}_*.json` beside this file; each row's own "
        "table has its command, budget and settings). Test R@1 etc. in %; untrained: the pretrained backbone "
        "on the same test images, so gain = R@1 - untrained. Cars196's unseen classes 99-196 unless the "
        "row's table says otherwise (the GPU table is a 40-class slice: Cars196 cannot reach the device "
        "machine, so Cars196 GPU rows were not run). frozen mean: the method's frozen-mode test R@1 over the "
        f"seeds {', '.join(map(str, FROZEN_SEEDS))} (train_all.json, train_all_seed1.json, ...), and over "
        "frozen = R@1 minus it (Cars196 rows only). wall: the whole run, validation and test included.",
        "",
        "| method | R@1 | R@2 | R@4 | MAP@R | untrained | gain | frozen mean | over frozen | seed | machine "
        "| steps (best) | train min | wall min | table |",
        "|" + "---|" * 15,
    ]
    for row in sorted(rows, key=lambda row: (row["machine"], row["method"], -row["recall@1"])):
        wall = "-" if row["wall_seconds"] is None else f"{row['wall_seconds'] / 60:.0f}"
        cars196 = row["frozen_mean_recall@1"] is not None and "_gpu" not in row["table"]
        over = f"{row['recall@1'] - row['frozen_mean_recall@1']:+.2f}" if cars196 else "-"
        mean = f"{row['frozen_mean_recall@1']:.2f}" if cars196 else "-"
        lines.append(
            f"| {row['method']} | {row['recall@1']:.2f} | {row['recall@2']:.2f} | {row['recall@4']:.2f} | "
            f"{row['map@r']:.2f} | {row['untrained_recall@1']:.2f} | "
            f"{row['recall@1'] - row['untrained_recall@1']:+.2f} | {mean} | {over} | {row['seed']} | "
            f"{row['machine']} | "
            f"{row['steps']} ({row['best_step']}) | {row['train_seconds'] / 60:.0f} | {wall} | "
            f"[{row['table']}]({row['table']}) |"
        )
    text = "\n".join(lines) + "\n"
    report = {"command": command, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "rows": rows}
    atomic_write_text(args.results_dir / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(args.results_dir / f"{stem}.md", text)
    return text


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("Cars196 images folder (not needed for --mean-of-seeds)", required=False),
        seed_option(),
    )
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="backbone feature cache")
    parser.add_argument("--runs-dir", type=Path, default=CACHE_DIR / "bench-runs")
    parser.add_argument("--methods", nargs="*", help="row labels to run (default: all)")
    parser.add_argument("--recipe", choices=RECIPE_NAMES, default=DEFAULT_RECIPE)
    parser.add_argument("--max-steps", type=int, help="override every recipe's step budget")
    parser.add_argument("--patience", type=int, help="override every recipe's early-stopping patience")
    parser.add_argument("--mode", choices=("frozen", "partial", "finetune"), default="frozen")
    parser.add_argument(
        "--time-budget", type=float, help="minutes of training steps per method (the run then stops)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: a GPU's rows, in tables of their own"
    )
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="override every recipe, e.g. views=2"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the tables are written")
    parser.add_argument("--mean-of-seeds", nargs="*", type=int, help="only average these seeds' tables")
    parser.add_argument(
        "--collect", action="store_true", help="only tabulate every run table of --mode in --results-dir"
    )
    args = parser.parse_args()

    register_peers()
    if args.mean_of_seeds:
        print(seeds_table(args))
        return
    if args.collect:
        print(collect_runs(args))
        return
    if args.data is None:
        parser.error("--data is required to train")
    table = args.results_dir / f"{table_stem(args.mode, args.recipe, args.seed, args.device)}.json"
    if table.exists() and "budget" not in json.loads(table.read_text()):  # found before hours of training
        parser.error(f"{table} is the --collect table: give this run another --results-dir")
    methods = all_methods()
    if args.methods:
        unknown = set(args.methods) - {method.label for method in methods}
        if unknown:
            parser.error(f"unknown methods {sorted(unknown)}; choose from {[m.label for m in methods]}")
        methods = [method for method in methods if method.label in args.methods]

    rows = []
    for method in methods:
        result = run_method(method, args)
        baseline = percent(result.pop("test_backbone"))
        rows.append({**result, "test": percent(result["test"]), "val": percent(result["val"])})
        print(f"{method.label}: test R@1 {rows[-1]['test']['recall@1']:.2f}", flush=True)
        table = write_table(args, rows, baseline)
    print(table)


if __name__ == "__main__":
    main()
