"""Accuracy parity of bfloat16 fine-tuning: the same run in float32 and in bfloat16, same seed and steps.

    python bench/precision_parity.py --data IMAGES --runs-dir DIR [--max-steps 50] [--threads N]
                                     [--loss angular] [--frozen-first] [--seed 0] [--precisions fp32 bf16]
                                     [--tabulate] [--same-step]
                                     [--out bench/results/precision_parity]

Runs ``bench/train_all.py --mode finetune`` twice on a CPU, ``precision=fp32`` and ``precision=bf16``, with
no early stop (``--patience`` above the step count), so both runs take exactly the same steps from the same
initial weights and batches: from the PCA head, or with ``--frozen-first`` from the recipe's frozen stage.
Then tabulates their validation Recall@1 curves and test metrics (``--tabulate`` tabulates finished runs
only). Meant for a CPU with native bfloat16 (elsewhere torch emulates it, slowly, and the run says so).

The interval beside each Recall@1 is the 95% percentile bootstrap over the queries of that split (a
binomial resample of the hit rate: the runs record the rate, not each query's hit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from lib.options import bench_parser, data_option, out_option, seed_option, threads_option

from foundation.atomic import atomic_write_text
from training.evaluation import embed_run
from training.metrics import evaluate
from training.run_dir import RunDirectory

PRECISIONS = ("fp32", "bf16")
RESAMPLES = 2000


def run(args: argparse.Namespace, precision: str) -> None:
    command = [sys.executable, str(Path(__file__).parent / "train_all.py"), "--mode", "finetune"]
    command += ["--methods", args.loss, "--data", str(args.data), "--cache-dir", str(args.runs_dir / "cache")]
    # Each precision's train_all table of its own (one directory would keep only the last run's row).
    command += [
        "--runs-dir",
        str(args.runs_dir / precision),
        "--results-dir",
        str(args.runs_dir / "tables" / precision),
    ]
    command += [
        "--max-steps",
        str(args.max_steps),
        "--patience",
        str(10 * args.max_steps),
        "--seed",
        str(args.seed),
    ]
    frozen_first = str(args.frozen_first).lower()
    command += ["--set", f"workers={args.workers}", f"frozen_first={frozen_first}", f"precision={precision}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(command, check=True, env=env)


def interval(rate: float, queries: int) -> tuple[float, float]:
    """95% percentile bootstrap interval of a hit rate over ``queries`` resampled queries, in %."""
    resampled = np.random.default_rng(0).binomial(queries, rate, size=RESAMPLES) / queries
    low, high = np.percentile(resampled, [2.5, 97.5])
    return round(100 * low, 2), round(100 * high, 2)


def collect(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for precision in PRECISIONS:
        path = args.runs_dir / precision / "finetune" / "recommended" / args.loss
        summary = RunDirectory(path).read_summary()
        if summary is None:
            sys.exit(f"no finished run at {path}: run without --tabulate first")
        config = json.loads((path / "config.json").read_text())
        curve = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        runs[precision] = {
            "compute": config["compute"],
            "steps": summary.steps,
            "best_step": summary.best_step,
            "train_seconds": summary.train_seconds,
            "curve": {str(point["step"]): round(100 * point["val"]["recall@1"], 2) for point in curve},
            "test": {name: round(100 * value, 2) for name, value in summary.test.items()},
            "test_backbone_recall@1": round(100 * summary.test_backbone["recall@1"], 2),
        }
        if args.same_step:  # the last checkpoints, in float32 as export runs them
            embedded = embed_run(path, args.data, progress=False, last=True)
            metrics = evaluate(embedded.trained, embedded.labels)
            runs[precision]["test_last"] = {name: round(100 * value, 2) for name, value in metrics.items()}
    return {
        "loss": args.loss,
        "max_steps": args.max_steps,
        "seed": args.seed,
        "runs": runs,
        "queries": queries(args),
    }


def queries(args: argparse.Namespace) -> dict[str, int]:
    """The validation and test query counts, from the split the runs used."""
    from training.data import load_labelled_images, split_classes

    split = split_classes(load_labelled_images(args.data))
    return {"val": len(split.val), "test": len(split.test)}


def markdown(result: dict[str, Any], command: str, machine: str) -> str:
    fp32, bf16 = (result["runs"][p] for p in PRECISIONS)
    n_val, n_test = result["queries"]["val"], result["queries"]["test"]

    def cell(rate: float, n: int) -> str:
        low, high = interval(rate / 100, n)
        return f"{rate:.2f} [{low:.2f}, {high:.2f}]"

    lines = [
        f"# bfloat16 against float32 fine-tuning ({result['loss']}, {result['max_steps']} steps, seed "
        f"{result.get('seed', 0)})",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine}.",
        "",
        f"fp32: {fp32['compute']['reason']}; bf16: {bf16['compute']['reason']}. Validation: {n_val} queries, "
        f"test: {n_test} queries (one query = {100 / n_test:.2f} points of test Recall@1); [low, high]: the "
        "95% bootstrap interval over the split's queries.",
        "",
        "| validation at step | fp32 R@1 | bf16 R@1 | difference |",
        "|---|---|---|---|",
    ]
    for step, rate in fp32["curve"].items():
        other = bf16["curve"].get(step)
        diff = "-" if other is None else f"{other - rate:+.2f}"
        lines.append(
            f"| {step} | {cell(rate, n_val)} | {'-' if other is None else cell(other, n_val)} | {diff} |"
        )
    lines += [
        "",
        "| run | test R@1 | test R@2 | test map@r | step tested (validation's choice) | train s |",
        "|---|---|---|---|---|---|",
        f"| untrained backbone | {fp32['test_backbone_recall@1']:.2f} | | | | |",
    ]
    for precision, run_ in result["runs"].items():
        test = run_["test"]
        lines.append(
            f"| {precision} | {cell(test['recall@1'], n_test)} | {test['recall@2']:.2f} "
            f"| {test['map@r']:.2f} | {run_['best_step']} | {run_['train_seconds']:.0f} |"
        )
    lines.append(
        f"\nTest Recall@1 difference (bf16 - fp32): "
        f"{bf16['test']['recall@1'] - fp32['test']['recall@1']:+.2f}."
    )
    if "test_last" in fp32 and "test_last" in bf16:
        lines += [
            "",
            f"At the same step, both runs' last checkpoints (step {fp32['steps']} and {bf16['steps']}; "
            "`--same-step`, embedded in float32 as the exported model runs):",
            "",
            "| run | test R@1 | test R@2 | test map@r |",
            "|---|---|---|---|",
        ]
        for precision in PRECISIONS:
            test = result["runs"][precision]["test_last"]
            recall = cell(test["recall@1"], n_test)
            lines.append(f"| {precision} | {recall} | {test['recall@2']:.2f} | {test['map@r']:.2f} |")
        difference = bf16["test_last"]["recall@1"] - fp32["test_last"]["recall@1"]
        lines.append(f"\nSame-step test Recall@1 difference (bf16 - fp32): {difference:+.2f}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option(),
        seed_option(help="the same in both runs"),
        threads_option(os.cpu_count() or 1),
        out_option(Path(__file__).parent / "results" / "precision_parity"),
    )
    parser.add_argument("--runs-dir", type=Path, required=True)
    parser.add_argument("--loss", default="angular")
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2, help="image loading processes per run")
    parser.add_argument(
        "--frozen-first",
        action="store_true",
        help="the fine-tuning recipe's frozen stage first (float32 head on cached features, the same in both "
        "runs), then the fine-tuning steps being compared",
    )
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISIONS,
        default=list(PRECISIONS),
        help="run only these (e.g. one per process, pinned to cores of their own; then --tabulate)",
    )
    parser.add_argument("--tabulate", action="store_true", help="only tabulate finished runs")
    parser.add_argument(
        "--same-step", action="store_true", help="also test both runs' last checkpoints (the same step)"
    )
    parser.add_argument("--machine", default=platform.processor() or platform.machine(), help="for the table")
    args = parser.parse_args()
    if not args.tabulate:
        for precision in args.precisions:
            run(args, precision)
        if set(args.precisions) != set(PRECISIONS):
            return
    result = collect(args)
    command = "python " + " ".join(sys.argv)
    made = args.out.with_suffix(".json")
    if args.tabulate and made.exists():  # the command that ran them stays in front
        command = f"{json.loads(made.read_text())['command']}`, tabulated by `{command}"
    report = {"command": command, "machine": args.machine, **result}
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    table = markdown(result, command, args.machine)
    atomic_write_text(args.out.with_suffix(".md"), table)
    print(table)


if __name__ == "__main__":
    main()
