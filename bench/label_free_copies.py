"""Edited copies as certain positives in label-free training (issue 39): with them, against byte copies only.

A Cars196 subset: ``--classes`` training classes from class 0 and as many unseen classes from class 98,
the first ``--per-class`` photos of each (a ``path,label`` table; runs read it with ``--labels none``).
``--share`` of the training photos (seeded) get one edited copy each, the kinds in turn: a centre crop to
90%, a quarter turn, a half-size resize (JPEG, quality 90) and a re-encode (JPEG, quality 50), written
under WORK/copies. Each seed then trains the label-free recipe of ``--methods`` twice on the training
photos and their copies, ``copies=exact`` (byte copies only: each edited copy is another photo) and
``copies=edited`` (the duplicate finder's edited tier, training.copies), and scores the selected
checkpoint on the unseen classes with their labels (bench/lib/label_free.py's ``unseen`` setting).

Also, per kind, how many copies the finder put in their original's group, and how many photos ended in a
group with another original photo (a false merge). Results: OUT.md and OUT.json.
"""

from __future__ import annotations

import csv
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch
from lib.duplicate_sets import make_copy
from lib.label_free import Row, run_setting
from lib.label_free_gate import VIEW_SEED, subset_table
from lib.options import bench_parser, data_option, out_option, threads_option
from PIL import Image

from engine.duplicates.tiers import Tier
from training.copies import copy_groups, signatures
from training.data import load_labelled_images
from training.features import FeatureExtractor

KINDS = {"crop": "cropped90", "turn": "rotated90", "resize": "resized", "re-encode": None}
QUALITY = {"re-encode": 50}  # the others are saved at JPEG quality 90
UNSEEN_FROM = 98  # Cars196's first test class, counted from 0


def write_copies(train: Path, share: float, seed: int, out: Path) -> tuple[Path, dict[str, tuple[str, str]]]:
    """``train`` (a table) plus an edited copy of ``share`` of its photos; each copy's original and kind."""
    images = load_labelled_images(train)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(images), size=round(share * len(images)), replace=False))
    rows = [
        (str(path), images.class_names[label])
        for path, label in zip(images.files(), images.labels, strict=True)
    ]
    made: dict[str, tuple[str, str]] = {}
    for n, index in enumerate(chosen):
        kind = list(KINDS)[n % len(KINDS)]
        original = images.files([index])[0]
        target = out / "copies" / f"{kind}_{original.parent.name}_{original.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(original) as image:
            edit = KINDS[kind]
            picture = make_copy(image.convert("RGB"), edit) if edit else image.convert("RGB")
            picture.save(target, format="JPEG", quality=QUALITY.get(kind, 90))
        rows.append((str(target), images.class_names[images.labels[index]]))
        made[str(target)] = (str(original), kind)
    table = out / "train_with_copies.csv"
    with table.open("w", newline="") as handle:
        csv.writer(handle).writerows([("path", "label"), *rows])
    return table, made


def finder_scores(table: Path, made: dict[str, tuple[str, str]], cache: Path) -> dict[str, object]:
    """Per kind, the copies grouped with their original; photos grouped with another original photo."""
    files = load_labelled_images(table).files()
    extractor = FeatureExtractor(cache, progress=False)
    pooled = extractor.extract(files)
    signed = signatures(files, cache, extractor.embedder.card.preprocessing.resize_size, progress=False)
    groups = copy_groups(files, pooled.features, pooled.ok, signed, Tier.EDITED)
    position = {str(path): n for n, path in enumerate(files)}
    source = np.array(
        [position[made[str(path)][0]] if str(path) in made else n for n, path in enumerate(files)]
    )
    found: dict[str, list[int]] = {kind: [0, 0] for kind in KINDS}
    for copy, (original, kind) in made.items():
        found[kind][0] += int(groups[position[copy]] == groups[position[original]])
        found[kind][1] += 1
    mixed = [group for group in np.unique(groups) if len(np.unique(source[groups == group])) > 1]
    return {
        "found": {kind: f"{hit}/{total}" for kind, (hit, total) in found.items()},
        "groups_with_two_originals": len(mixed),
        "photos_in_them": int(np.isin(groups, mixed).sum()),
    }


def markdown(rows: list[Row], finder: dict[str, object], command: str) -> str:
    lines = [
        "# Edited copies as certain positives, label-free (issue 39)",
        "",
        f"`{command}`",
        "",
        f"The finder on the training photos and their copies: copies grouped with their original, per kind: "
        f"{finder['found']}; groups joining two original photos: {finder['groups_with_two_originals']} "
        f"({finder['photos_in_them']} photos).",
        "",
        "| method | setting | recall@1 | untrained | gain | minutes | seed | served by the gate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.method} | {r.setting} | {r.recall_at_1:.2f} | {r.untrained:.2f} | {r.gain:+.2f} | "
        f"{r.minutes:.1f} | {r.seed} | {'yes' if r.served else 'no'} |"
        for r in rows
    ]
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        by.setdefault((r.method, r.setting), []).append(r.recall_at_1)
    lines += [
        "",
        "| method | setting | mean recall@1 | seeds | spread (max - min) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {method} | {setting} | {np.mean(values):.2f} | {len(values)} | {max(values) - min(values):.2f} |"
        for (method, setting), values in by.items()
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("labelled image folder (CARS196/images: its training classes come first)"),
        out_option(Path("bench/results/label_free_copies"), "results: OUT.md and OUT.json"),
        threads_option(1),
    )
    parser.add_argument("--classes", type=int, default=60, help="training classes, and as many unseen ones")
    parser.add_argument("--per-class", type=int, default=16, help="photos per class (first by name)")
    parser.add_argument("--share", type=float, default=0.25, help="training photos that get an edited copy")
    parser.add_argument("--methods", nargs="+", default=["ms"], help="losses (dmlsearch losses)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--copies", nargs="+", choices=["exact", "edited"], default=["exact", "edited"], help="copies merged"
    )
    parser.add_argument("--max-steps", type=int, default=600, help="training steps per run")
    parser.add_argument("--every", type=int, default=100, help="steps between validations")
    parser.add_argument("--work", type=Path, default=Path("runs/label_free_copies"), help="runs and caches")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work, cache = args.work, args.work / "cache"
    train = subset_table(args.data.resolve(), args.classes, args.per_class, work / "train.csv")
    unseen = subset_table(
        args.data.resolve(), args.classes, args.per_class, work / "unseen.csv", first=UNSEEN_FROM
    )
    scored = work / "scored.csv"  # training classes first by name, so its test half is the unseen classes
    scored.write_text(train.read_text() + "".join(unseen.read_text().splitlines(keepends=True)[1:]))
    table, made = write_copies(train, args.share, 0, work)
    settings = {
        "max_steps": args.max_steps,
        "eval_every": args.every,
        "view_seed": VIEW_SEED,
        "patience": 10**6,
    }
    rows = []
    for seed in args.seeds:
        for method in args.methods:
            for copies in args.copies:
                row = run_setting(
                    method,
                    "unseen",
                    scored,
                    work,
                    seed=seed,
                    cache=cache,
                    trained_on=table,
                    name=f"-{copies}",
                    copies=copies,
                    **settings,
                )
                rows.append(Row(**{**vars(row), "setting": f"unseen, copies={copies}, share={args.share}"}))
                print(rows[-1], flush=True)
    finder = finder_scores(table, made, cache)
    command = "python bench/label_free_copies.py " + shlex.join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(rows, finder, command))
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "finder": finder, "rows": [row.to_dict() for row in rows]}, indent=2)
        + "\n"
    )
    print(markdown(rows, finder, command))


if __name__ == "__main__":
    main()
