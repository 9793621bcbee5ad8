"""How often the label-free gate agrees with the true change in class Recall@1 (issue 39).

On a labelled subset (CLASSES classes from FIRST_CLASS, PER_CLASS photos each), split into two halves of
classes: for each half and seed, one run trains without labels on that half's photos (frozen, read every
EVERY steps), and is scored with the labels on the other half's classes (unseen) and on its own photos
(own-gallery). Each label-free check's gate is replayed on the checkpoints (bench/lib/label_free_gate.py
says how), and so are two gates of crop and strong-neighbours together: the trainer's (crop selects, both
must find that checkpoint better) and the replay's (label_free_gate.both).
Results: OUT.md and OUT.json (every case per check, and the agreement rate per check)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from lib.label_free_gate import (
    HALVES,
    TRAINER_GATE,
    Subset,
    Verdict,
    both,
    markdown,
    replay,
    subset_table,
    summary_rows,
    to_dicts,
    train_in_chunks,
)
from lib.options import bench_parser, data_option, out_option, threads_option


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("labelled image folder (CARS196/images: its training classes come first)"),
        out_option(Path("bench/results/label_free_gate"), "results: OUT.md and OUT.json"),
        threads_option(1),
    )
    parser.add_argument("--classes", type=int, default=60, help="classes of the subset")
    parser.add_argument(
        "--first-class",
        type=int,
        default=0,
        help="the subset's first class, counted from 0 (98: Cars196's test classes, which no run trains on)",
    )
    parser.add_argument("--per-class", type=int, default=16, help="photos per class (first by name)")
    parser.add_argument("--methods", nargs="+", default=["ms"], help="losses (dmlsearch losses)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600, help="training steps per run")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints read")
    parser.add_argument(
        "--work", type=Path, default=Path("runs/label_free_gate"), help="runs and feature cache"
    )
    parser.add_argument("--cache", type=Path, help="feature cache (default: WORK/cache)")
    parser.add_argument("--views", type=int, help="cached augmented views per photo (default: the recipe's)")
    args = parser.parse_args()
    settings = {} if args.views is None else {"views": args.views}
    torch.set_num_threads(args.threads)
    cache = args.cache or args.work / "cache"
    subset = Subset.load(
        subset_table(
            args.data, args.classes, args.per_class, args.work / "subset.csv", first=args.first_class
        ),
        cache,
    )
    verdicts = []
    for method in args.methods:
        for seed in args.seeds:
            for half in HALVES:
                started = time.perf_counter()
                checkpoints, untrained, held = train_in_chunks(
                    method,
                    half,
                    subset,
                    args.work,
                    cache,
                    seed=seed,
                    steps=args.steps,
                    every=args.every,
                    settings=settings,
                )
                verdicts += replay(method, half, seed, checkpoints, untrained, held)
                minutes = (time.perf_counter() - started) / 60
                print(f"{method} half {half} seed {seed}: {minutes:.1f} min", flush=True)
                write(args, verdicts)
    print(markdown(verdicts + both(verdicts, *TRAINER_GATE), command(), notes(args)))


def command() -> str:
    return "python bench/label_free_gate.py " + shlex.join(sys.argv[1:])


def notes(args: argparse.Namespace) -> str:
    return (
        f"Subset: {args.classes} classes of {args.data} from class {args.first_class} (counted from 0), "
        f"the first {args.per_class} photos of "
        "each by name; halves A (first classes) and B. Each run: frozen, the method's recommended recipe "
        f"with views={args.views or 'the recipe'}, without labels on one half's photos, read every "
        f"{args.every} of {args.steps} steps. A case is a run in one setting: unseen (class retrieval on "
        "the other half) or own-gallery (on its own photos). Gain: class Recall@1 of the checkpoint the "
        "check selects minus the untrained backbone's. Agrees: served exactly when the gain is above 0."
    )


def write(args: argparse.Namespace, verdicts: list[Verdict]) -> None:
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    verdicts = verdicts + both(verdicts, *TRAINER_GATE)
    out.with_suffix(".md").write_text(markdown(verdicts, command(), notes(args)))
    record = {"command": command(), "summary": summary_rows(verdicts), "cases": to_dicts(verdicts)}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
