"""Train without labels and score with them (issue 39): `unseen` (train on the first half of the classes,
labels removed; test on the second half) and `own-gallery` (train on the second half's photos without
labels, search those photos). Results: bench/results/label_free.md and .json, one row per method,
setting and seed (method, setting, recall@1, untrained, gain, minutes, seed, served)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch
from lib.label_free import SETTINGS, markdown, run_setting
from lib.options import bench_parser, data_option, out_option, seed_option, threads_option


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("labelled image folder (CARS196/images)"),
        out_option(Path("bench/results/label_free"), "results: OUT.md and OUT.json"),
        threads_option(1),
        seed_option(),
    )
    parser.add_argument("--methods", nargs="+", default=["ms"], help="losses (dmlsearch losses)")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--work", type=Path, default=Path("runs/label_free"), help="runs and feature cache")
    parser.add_argument("--max-steps", type=int, help="training steps per run (default: the trainer's)")
    parser.add_argument("--time-budget", type=float, help="minutes of training steps per run")
    parser.add_argument(
        "--mode",
        choices=["frozen", "partial", "finetune", "auto"],
        default="frozen",
        help="auto (needs --time-budget): as `dmlsearch train` on a CPU without --mode, fine-tune if "
        "enough steps fit the budget, measured, else frozen",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "auto" and args.time_budget is None:
        parser.error("--mode auto needs --time-budget")
    settings: dict[str, object] = {"mode": args.mode}
    if args.max_steps is not None:
        settings["max_steps"] = args.max_steps
    if args.time_budget is not None:
        settings["time_budget"] = 60 * args.time_budget
    rows = [
        run_setting(method, setting, args.data, args.work, seed=args.seed, **settings)
        for method in args.methods
        for setting in args.settings
    ]
    command = "python bench/label_free.py " + shlex.join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(rows, command))
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "rows": [row.to_dict() for row in rows]}, indent=2) + "\n"
    )
    print(markdown(rows, command))


if __name__ == "__main__":
    main()
