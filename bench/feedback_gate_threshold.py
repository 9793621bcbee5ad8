"""The judgments gate's neighbourhood threshold (training.feedback_gate.MIN_NEIGHBOURS_KEPT) on cells never
used to choose it, and chosen by cross-validation over the cells (issue 40).

Reads the learning rows of bench/feedback_loop.py results (--results: the cells the threshold was chosen
on, --new: cells run afterwards) and, over the runs that trained (selected step > 0), says for each
threshold how many keep at least that share of their unjudged neighbourhoods and how many of those lost
R@1 on the photos nobody judged. Leave-one-cell-out: per held-out cell, the threshold is the lowest of a
0.01 grid above every run of the other cells that lost R@1 (no margin), and the held-out cell's runs are
judged by it. No training: it reads the files. Results: OUT.md and OUT.json."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from lib.options import bench_parser, out_option

from training.feedback_gate import MIN_NEIGHBOURS_KEPT

GRID = [round(0.5 + 0.01 * step, 2) for step in range(46)]  # 0.50 .. 0.95
SHOWN = (0.70, 0.72, MIN_NEIGHBOURS_KEPT, 0.78, 0.80)


def _rows(paths: list[Path], new: bool) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        for row in json.loads(path.read_text())["learning"]["rows"]:
            if row.get("unjudged_neighbours_kept") is not None and row["best_step"] > 0:
                rows.append({**row, "new": new})
    return rows


def _fell(row: dict[str, Any]) -> bool:
    return row["recall@1_after"] < row["recall@1_before"]


def _kept(row: dict[str, Any]) -> float:
    return row["unjudged_neighbours_kept"]


def _judge(rows: list[dict[str, Any]], threshold: float) -> dict[str, int]:
    kept = [row for row in rows if _kept(row) >= threshold]
    return {
        "runs": len(rows),
        "kept_at_least": len(kept),
        "of_which_fell": sum(map(_fell, kept)),
        "below_that_did_not_fall": sum(1 for row in rows if _kept(row) < threshold and not _fell(row)),
    }


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/feedback_gate_threshold"), "OUT.md/.json"))
    parser.add_argument("--results", type=Path, nargs="+", required=True, help="cells it was chosen on")
    parser.add_argument("--new", type=Path, nargs="+", required=True, help="cells run afterwards")
    args = parser.parse_args()
    chosen_on, new = _rows(args.results, False), _rows(args.new, True)
    every = chosen_on + new
    cells = sorted({(row["seed"], row["fold"]) for row in every})
    cross: list[dict[str, Any]] = []
    for cell in cells:
        others = [row for row in every if (row["seed"], row["fold"]) != cell]
        threshold = next(t for t in GRID if not any(_fell(row) and _kept(row) >= t for row in others))
        held = [row for row in every if (row["seed"], row["fold"]) == cell]
        cross.append({"seed": cell[0], "fold": cell[1], "threshold": threshold, **_judge(held, threshold)})
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "threshold": MIN_NEIGHBOURS_KEPT,
        "new_cells": _judge(new, MIN_NEIGHBOURS_KEPT),
        "thresholds": {str(t): {"chosen_on": _judge(chosen_on, t), "new": _judge(new, t)} for t in SHOWN},
        "cross_validation": cross,
        "runs": [
            {key: row[key] for key in ("seed", "fold", "strategy", "new", "unjudged_neighbours_kept")}
            | {"gain": round(100 * (row["recall@1_after"] - row["recall@1_before"]), 2)}
            for row in every
        ],
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(result))
    print(args.out.with_suffix(".md").read_text())


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# The judgments gate's neighbourhood threshold on new cells (issue 40)",
        "",
        "Runs that trained (selected step > 0), frozen, 500 judgments. The threshold in use: "
        f"{result['threshold']:.2f} (training/feedback_gate.py), chosen on the first cells. `kept`: the mean "
        "share of each unjudged photo's 10 nearest unjudged photos kept; `fell`: R@1 on the fold's "
        "never-judged photos fell.",
        "",
        "| threshold | chosen-on cells: kept >= it | of which fell | below it, did not fall "
        "| new cells: kept >= it | of which fell | below it, did not fall |",
        "|---|---|---|---|---|---|---|",
    ]
    for threshold, seen in result["thresholds"].items():
        old, new = seen["chosen_on"], seen["new"]
        cells = [
            f"{seen_in['kept_at_least']}/{seen_in['runs']} | {seen_in['of_which_fell']} "
            f"| {seen_in['below_that_did_not_fall']}"
            for seen_in in (old, new)
        ]
        lines.append(f"| {float(threshold):.2f} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "Leave one cell out: the threshold is the lowest (0.01 grid) above every run of the other cells that "
        "fell, without margin; the held-out cell's runs are judged by it.",
        "",
        "| held-out cell | threshold | runs | kept >= it | of which fell | below it, did not fall |",
        "|---|---|---|---|---|---|",
    ]
    for cell in result["cross_validation"]:
        lines.append(
            f"| seed {cell['seed']} fold {cell['fold']} | {cell['threshold']:.2f} | {cell['runs']} "
            f"| {cell['kept_at_least']} | {cell['of_which_fell']} | {cell['below_that_did_not_fall']} |"
        )
    lines += ["", "| seed | fold | run | new cell | kept | R@1 gain |", "|---|---|---|---|---|---|"]
    for run in sorted(result["runs"], key=lambda run: run["unjudged_neighbours_kept"]):
        lines.append(
            f"| {run['seed']} | {run['fold']} | {run['strategy']} | {'yes' if run['new'] else 'no'} "
            f"| {run['unjudged_neighbours_kept']:.3f} | {run['gain']:+.2f} |"
        )
    lines += ["", f"Command: `{result['command']}`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
