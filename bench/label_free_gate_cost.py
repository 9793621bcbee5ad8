"""What the label-free gate's second check costs a fine-tuning run on this CPU (issue 39).

    python bench/label_free_gate_cost.py --data CARS196/images [--photos 300] [--threads 2]

The check (training.trainer._Training._neighbourhood_check) embeds the run's training photos once more
and a strong view of each validation photo, through the whole network at the serving size, as
training.workloads.FinetuneWorkload.embed does. Measured here: that embedding's images per second on
``--photos`` photos of the folder, against a fine-tuning step's (training.budget.measure, the speed
the CPU plan is made from) in the same process, as a ratio; and from it the check's minutes for
folders of a few sizes, with a label-free run's split (a tenth held out for validation, a tenth for test).
``--out`` writes OUT.md and OUT.json.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
from lib.options import bench_parser, data_option, out_option, threads_option

from foundation.atomic import atomic_write_text
from training.backbone import BACKBONES
from training.budget import measure
from training.label_free_data import HELD_OUT_SHARE
from training.model import build_objective
from training.recipes import LABEL_FREE_AUTO_LOSS, resolve
from training.workloads import FinetuneWorkload

FOLDERS = (500, 2000, 8054)  # a new user's folder, a larger one, Cars196's 98 training classes


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("photos (CARS196/images: the first photos by name)"),
        out_option(Path("bench/results/label_free_gate_cost"), "OUT.md and OUT.json"),
        threads_option(2),
    )
    parser.add_argument("--photos", type=int, default=300, help="photos embedded to time the check's pass")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    files = sorted(path for path in args.data.rglob("*.jpg"))[: args.photos]
    loss = LABEL_FREE_AUTO_LOSS
    config = resolve(loss, mode="finetune", label_free=True).config(loss, str(args.data))
    objective = build_objective(config, BACKBONES[config.backbone].feature_dim)
    workload = FinetuneWorkload(
        objective, {"photos": files}, BACKBONES[config.backbone].preprocessing, torch.device("cpu")
    )
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    workload.embed("photos")
    check_img_s = len(files) / (time.perf_counter() - started)
    step_img_s = measure(config).img_per_s
    load_after = os.getloadavg()[0]
    rows = []
    for photos in FOLDERS:
        val = round(HELD_OUT_SHARE * photos)
        embedded = photos - 2 * val + val  # the training photos, and a strong view of each validation photo
        rows.append(
            {"photos": photos, "embedded": embedded, "minutes": round(embedded / check_img_s / 60, 1)}
        )
    record = {
        "command": "python bench/label_free_gate_cost.py " + shlex.join(sys.argv[1:]),
        "threads": args.threads,
        "load_average": [round(load_before, 1), round(load_after, 1)],
        "check_img_per_s": round(check_img_s, 2),
        "train_size": config.train_size,
        "step_img_per_s": round(step_img_s, 2),
        "ratio": round(check_img_s / step_img_s, 2),
        "folders": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(record, indent=2) + "\n")
    atomic_write_text(args.out.with_suffix(".md"), markdown(record))
    print(markdown(record))


def markdown(record: dict) -> str:
    lines = [
        "# The label-free gate's second check in a fine-tuning run: what it costs (issue 39)",
        "",
        f"`{record['command']}`",
        "",
        f"{record['threads']} threads, load average {record['load_average'][0]} before and "
        f"{record['load_average'][1]} after, on the 2 cores. The check's pass (the whole network, float32, "
        f"at the serving size): {record['check_img_per_s']} img/s; a fine-tuning step "
        f"(train_size {record['train_size']}): {record['step_img_per_s']} img/s; ratio "
        f"{record['ratio']} (a photo the check embeds costs 1/{record['ratio']} of a training image).",
        "",
        "| folder photos | images the check embeds | minutes at the measured speed |",
        "|---|---|---|",
    ]
    lines += [f"| {row['photos']} | {row['embedded']} | {row['minutes']} |" for row in record["folders"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
