"""Would another label-free gate serve more of the runs that gained? Cross-validated on recorded cases
(issue 39).

Reads bench/label_free_gate.py's cases (runs scored with labels; each run is two cases, ``unseen`` and
``own-gallery``, on the checkpoint the crop check selected) and replays, without training again, rules of
three families on what the trainer's gate sees of a run: the crop check and the neighbourhood check on that
checkpoint (``crop>strong-neighbours`` rows), each as its difference from the untrained backbone and the
low end of its 95% bootstrap interval, in points:

* ``intervals``: serve where crop low > A and neighbours low > B (the trainer's rule: A = B = 0);
* ``estimates``: serve where the crop difference > A and the neighbours difference > B;
* ``crop-window``: serve where 0 < the crop difference <= A and the neighbours difference > B (a run
  that finds its own held-out views far better may have learned the views, not the classes).

A rule is chosen on some runs and tested on the others: leave one run out, and by data (the runs of one
class subset chosen on, the other's tested). The choice: the most cases served whose class Recall@1 rose,
among the rules that serve no case below untrained on the runs chosen on (ties: the strictest). Also the
interval widths by held-out photos. Results: OUT.md and OUT.json.
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lib.label_free_gate import TRAINER_CHECK
from lib.options import bench_parser, out_option

GRID = np.arange(-8.0, 8.5, 0.5)  # thresholds tried, in points
WINDOW = np.arange(1.0, 12.5, 0.5)  # crop-window upper bounds tried


@dataclass(frozen=True)
class Run:
    name: str
    held_out: int
    step: int
    crop: float  # the crop check's difference from untrained
    crop_low: float
    neighbours: float
    neighbours_low: float
    gains: tuple[float, float]  # true class Recall@1 change: unseen, own-gallery
    served_now: bool


def load_runs(paths: list[Path]) -> list[Run]:
    cases = [case for path in paths for case in json.loads(path.read_text())["cases"]]
    by: dict[tuple, dict[str, dict[str, dict]]] = {}
    for c in cases:
        key = (c["method"], c["half"], c["seed"], c["held_out"])
        by.setdefault(key, {}).setdefault(c["check"], {})[c["setting"]] = c
    runs = []
    for key, checks in sorted(by.items()):
        if TRAINER_CHECK not in checks:
            continue  # recorded before the trainer's gate: no neighbourhood score on crop's checkpoint
        crop, neighbours = checks["crop"]["unseen"], checks[TRAINER_CHECK]["unseen"]
        runs.append(
            Run(
                name="-".join(map(str, key)),
                held_out=crop["held_out"],
                step=crop["selected_step"],
                crop=crop["check_selected"] - crop["check_untrained"],
                crop_low=crop["low"],
                neighbours=neighbours["check_selected"] - neighbours["check_untrained"],
                neighbours_low=neighbours["low"],
                gains=(checks["crop"]["unseen"]["gain"], checks["crop"]["own-gallery"]["gain"]),
                served_now=neighbours["served"],
            )
        )
    return runs


def rules() -> list[tuple[str, float, float]]:
    found = [
        (family, a, b) for family in ("intervals", "estimates") for a, b in itertools.product(GRID, GRID)
    ]
    return found + [("crop-window", a, b) for a, b in itertools.product(WINDOW, GRID)]


def serves(rule: tuple[str, float, float], run: Run) -> bool:
    family, a, b = rule
    if run.step == 0:
        return False
    if family == "intervals":
        return run.crop_low > a and run.neighbours_low > b
    if family == "estimates":
        return run.crop > a and run.neighbours > b
    return 0 < run.crop <= a and run.neighbours > b


def tally(rule: tuple[str, float, float], runs: list[Run]) -> dict[str, int]:
    served = [run for run in runs if serves(rule, run)]
    return {
        "runs": len(runs),
        "served_runs": len(served),
        "served_cases_gained": sum(gain > 0 for run in served for gain in run.gains),
        "served_cases_below": sum(gain < 0 for run in served for gain in run.gains),
        "refused_cases_gained": sum(gain > 0 for run in runs if not serves(rule, run) for gain in run.gains),
    }


def strictness(rule: tuple[str, float, float]) -> tuple[float, float]:
    family, a, b = rule
    return (-a if family == "crop-window" else a, b)


def choose(family: str, runs: list[Run]) -> tuple[str, float, float]:
    """The family's rule serving the most gained cases with none below untrained on ``runs``."""
    safe = [rule for rule in rules() if rule[0] == family and tally(rule, runs)["served_cases_below"] == 0]
    return max(safe, key=lambda rule: (tally(rule, runs)["served_cases_gained"], strictness(rule)))


def cross_validate(family: str, folds: list[tuple[list[Run], list[Run]]]) -> dict[str, object]:
    totals: dict[str, int] = {}
    chosen = []
    for choose_on, test_on in folds:
        rule = choose(family, choose_on)
        chosen.append(f"{rule[1]:+.1f}/{rule[2]:+.1f}")
        for key, value in tally(rule, test_on).items():
            totals[key] = totals.get(key, 0) + value
    return {"family": family, **totals, "chosen": sorted(set(chosen))}


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/label_free_gate_cv"), "OUT.md/.json"))
    parser.add_argument(
        "--cases", type=Path, nargs="+", default=[Path("bench/results/label_free_gate_rescored.json")]
    )
    args = parser.parse_args()
    runs = load_runs(args.cases)
    sizes = sorted({run.held_out for run in runs})
    one_out = [([r for r in runs if r is not run], [run]) for run in runs]
    by_data = [
        ([r for r in runs if r.held_out == size], [r for r in runs if r.held_out != size]) for size in sizes
    ]
    trainer_rule = ("intervals", 0.0, 0.0)
    families = ("intervals", "estimates", "crop-window")
    results = {
        "trainer's rule (crop low > 0 and neighbours low > 0)": tally(trainer_rule, runs),
        "leave one run out": [cross_validate(family, one_out) for family in families],
        "chosen on one class subset, tested on the other": [
            cross_validate(family, by_data) for family in families
        ],
        "chosen on all runs (no test: what fits them)": [
            {"family": family, "rule": choose(family, runs)[1:], **tally(choose(family, runs), runs)}
            for family in families
        ],
    }
    widths = {
        str(size): {
            "crop half-width": round(
                float(np.mean([r.crop - r.crop_low for r in runs if r.held_out == size])), 2
            ),
            "neighbours half-width": round(
                float(np.mean([r.neighbours - r.neighbours_low for r in runs if r.held_out == size])), 2
            ),
        }
        for size in sizes
    }
    command = "python bench/label_free_gate_cv.py " + shlex.join(sys.argv[1:])
    record = {
        "command": command,
        "results": results,
        "interval_widths": widths,
        "runs": [vars(r) for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Label-free gate rules, cross-validated on recorded cases (issue 39)",
        "",
        f"`{command}` (nothing trained: {', '.join(map(str, args.cases))})",
        "",
        "| run | held-out photos | step | crop diff | crop low | neighbours diff | neighbours low "
        "| gain unseen | gain own-gallery | served now |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.name} | {r.held_out} | {r.step} | {r.crop:+.2f} | {r.crop_low:+.2f} | {r.neighbours:+.2f} | "
        f"{r.neighbours_low:+.2f} | {r.gains[0]:+.2f} | {r.gains[1]:+.2f} | "
        f"{'yes' if r.served_now else 'no'} |"
        for r in runs
    ]
    lines += [
        "",
        "Mean half-width of the 95% interval (points) by held-out photos: " + json.dumps(widths),
        "",
    ]
    for title, rows in results.items():
        lines.append(f"## {title}")
        lines.append("")
        lines.append("```")
        lines.append(json.dumps(rows, indent=1))
        lines.append("```")
        lines.append("")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
