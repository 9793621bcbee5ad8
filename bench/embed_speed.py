"""Per-image embedding time: torch eager vs onnxruntime fp32 vs onnxruntime int8, batch 1 and 32, one run.

    python bench/embed_speed.py [--threads 2] [--repeats 5]
                                [--calibration CARS196/images] [--calibration-count 300]

All three run the same pretrained model with the same thread count. With ``--calibration`` the fp32
export is also quantised to int8 (``training.quantize``, as ``dmlsearch export --int8`` does) on that
folder's images. Each figure is the minimum over ``--repeats`` timed runs after a warm-up, so that other
load on the machine inflates it as little as possible. ``--out`` writes the table as .md and .json.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from lib.options import bench_parser, out_option, threads_option

from engine.model.embedder import Embedder
from foundation import defaults
from foundation.atomic import atomic_write_text
from training.backbone import BACKBONES, create_backbone
from training.export import export_onnx
from training.model import EmbeddingModel


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return min(timings)


def main() -> None:
    parser = bench_parser(
        __doc__, threads_option(2), out_option(help="Write the table to OUT.md and OUT.json.")
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calibration", type=Path, help="Image folder to calibrate an int8 model on.")
    parser.add_argument("--calibration-count", type=int, default=defaults.CALIBRATION_IMAGES)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = EmbeddingModel(create_backbone("efficientnet_lite0")).eval()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as workdir:
        model_path = Path(workdir) / "model.onnx"
        export_onnx(
            model,
            model_path,
            preprocessing=BACKBONES["efficientnet_lite0"].preprocessing,
            backbone="efficientnet_lite0",
        )
        runtimes: dict[str, Callable[[np.ndarray], object]] = {}

        def run_torch(batch: np.ndarray) -> object:
            with torch.inference_mode():
                return model(torch.from_numpy(batch))

        runtimes["torch eager"] = run_torch
        runtimes["onnxruntime fp32"] = Embedder(model_path, threads=args.threads).embed_tensor
        if args.calibration is not None:
            from training.quantize import calibration_files, quantize_int8

            int8_path = Path(workdir) / "int8" / "model.onnx"
            int8_path.parent.mkdir()
            shutil.copy(model_path, int8_path)
            shutil.copy(model_path.with_suffix(".json"), int8_path.with_suffix(".json"))
            quantize_int8(int8_path, calibration_files(args.calibration, args.calibration_count))
            runtimes["onnxruntime int8"] = Embedder(int8_path, threads=args.threads).embed_tensor
        rows = []
        for batch_size in (1, 32):
            batch = np.random.default_rng(0).standard_normal((batch_size, 3, 224, 224)).astype(np.float32)
            row: dict[str, object] = {"batch": batch_size}
            for name, run in runtimes.items():
                seconds = best_seconds(lambda run=run, batch=batch: run(batch), args.repeats)
                row[f"{name} ms/img"] = seconds * 1000 / batch_size
            rows.append(row)
    load_end = os.getloadavg()

    names = list(runtimes)
    ratios = [("onnxruntime fp32 vs torch", "torch eager", "onnxruntime fp32")]
    if "onnxruntime int8" in runtimes:
        ratios.append(("int8 vs fp32", "onnxruntime fp32", "onnxruntime int8"))
    for row in rows:
        for label, slow, fast in ratios:
            row[f"speed-up {label}"] = row[f"{slow} ms/img"] / row[f"{fast} ms/img"]
    command = "python " + shlex.join(sys.argv)
    header = [
        "batch",
        *(f"{name} ms/img" for name in names),
        *(f"speed-up {label}" for label, _, _ in ratios),
    ]
    lines = [
        "# Embedding speed",
        "",
        f"`{command}`",
        "",
        f"{args.threads} threads, min of {args.repeats} runs; load average (1, 5, 15 min) at start "
        f"{', '.join(f'{v:.2f}' for v in load_start)}, at end {', '.join(f'{v:.2f}' for v in load_end)}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in rows:
        cells = [str(row["batch"])]
        cells += [f"{row[f'{name} ms/img']:.2f}" for name in names]
        cells += [f"{row[f'speed-up {label}']:.2f}x" for label, _, _ in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out is not None:
        meta = {"command": command, "threads": args.threads, "repeats": args.repeats}
        meta.update(load_average_start=load_start, load_average_end=load_end)
        atomic_write_text(args.out.with_suffix(".json"), json.dumps({"meta": meta, "rows": rows}, indent=2))
        atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
