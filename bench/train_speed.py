"""Training speed and memory on this machine: frozen extraction, partial and finetune steps, by precision.

    python bench/train_speed.py [--batches 32 64] [--memory-batch 128] [--finetune-size 160] [--steps 3]
                                [--modes frozen-extract partial finetune]
                                [--threads 2] [--bf16 auto|on|off] [--out bench/results/train_speed]

Each row runs in its own process (so peak resident memory, ``ru_maxrss``, is that row's alone) on random
images, with the trainer's own parts (``build_objective``, ``resolve_compute``, Adam, MS loss):

* ``frozen-extract``: the pretrained backbone's pooled features without gradients (torch), plus the
  onnxruntime row that frozen and partial runs actually extract with (the cache stays float32 ONNX);
* ``partial``: one training step of the last stage + head on the 192x7x7 maps entering it;
* ``finetune``: one training step of the whole network on ``--finetune-size`` px crops (the fine-tuning
  recipe's ``train_size`` by default), the backbone in chunks of ``backbone_chunk`` images (TrainConfig's
  default; the ``chunk`` field) with activation checkpointing. At the recipe's batch (``--memory-batch``)
  it runs float32 and channels-last+bf16, each with the default chunks and without chunks (``chunk`` 0),
  for the memory goal and the speed at the batch a run really takes.

Settings: ``fp32`` (contiguous, float32: the trainer before issue 25), ``channels_last``, and
``channels_last+bf16`` (bfloat16 autocast, float32 weights and loss). Where the CPU has no native
bfloat16 that row runs with it forced off (``bf16_used`` false), as a run there would, unless
``--bf16 on`` makes torch emulate it; ``--bf16 off`` runs every row as a CPU without it would. ``speedup``
is against ``fp32`` at the same mode and batch in the same run. Figures are img/s over ``--steps`` timed
steps after one warm-up step. On a machine shared with other work, compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lib.options import bench_parser, out_option, threads_option

from training.config import TrainConfig
from training.precision import Compute, cpu_has_native_bf16, model_inputs
from training.recipes import FINETUNE

SETTINGS = ("fp32", "channels_last", "channels_last+bf16")
CLASSES_PER_BATCH_SAMPLES = 4  # the MS recipe's layout: classes x 4 images
EXTRACT_SIZE = 224  # what frozen extraction embeds, and the images partial's cached maps come from


def compute_for(setting: str, bf16_mode: str) -> Compute:
    device = torch.device("cpu")
    channels_last = setting != "fp32"
    wants_bf16 = setting.endswith("+bf16")
    bf16 = wants_bf16 and {"auto": cpu_has_native_bf16(), "on": True, "off": False}[bf16_mode]
    return Compute(device, torch.bfloat16 if bf16 else None, channels_last, setting)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def timed(step: Any, steps: int, batch: int) -> float:
    step()  # warm-up: oneDNN primitive creation, allocator growth
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - started)


def run_row(row: dict[str, Any], steps: int, bf16_mode: str) -> dict[str, Any]:
    """One measurement, in this process."""
    from training.features import backbone_model
    from training.model import build_objective

    mode, setting, batch = row["mode"], row["setting"], row["batch"]
    generator = torch.Generator().manual_seed(0)
    if setting == "onnxruntime":
        from engine.model.embedder import Embedder

        with tempfile.TemporaryDirectory() as cache:
            embedder = Embedder(backbone_model(Path(cache), "efficientnet_lite0"))
            images = torch.randn(batch, 3, row["size"], row["size"], generator=generator).numpy()
            speed = timed(lambda: embedder.embed_tensor(images), steps, batch)
        return {**row, "img_per_s": speed, "bf16_used": False, "peak_rss_mb": peak_rss_mb()}

    compute = compute_for(setting, bf16_mode)
    chunk = row.get("chunk", TrainConfig.model_fields["backbone_chunk"].default)
    config = TrainConfig(loss="ms", data="-", mode="finetune" if mode == "frozen-extract" else mode)
    config = config.model_copy(update={"backbone_chunk": chunk})
    objective = build_objective(config, 1280)
    compute.prepare_module(objective)
    if mode == "frozen-extract":
        backbone = objective.backbone.eval()
        images = torch.randn(batch, 3, row["size"], row["size"], generator=generator)
        images = model_inputs(images, compute.channels_last)

        @torch.no_grad()
        def step() -> None:
            with compute.autocast_context():
                backbone(images).float()

    else:
        shape = (192, 7, 7) if mode == "partial" else (3, row["size"], row["size"])
        inputs = model_inputs(torch.randn(batch, *shape, generator=generator), compute.channels_last)
        labels = torch.arange(batch // CLASSES_PER_BATCH_SAMPLES).repeat_interleave(CLASSES_PER_BATCH_SAMPLES)
        optimizer = torch.optim.Adam(objective.parameters(), lr=1e-5)
        objective.train()

        def step() -> None:  # the trainer's step (training/trainer.py), without its bookkeeping
            with compute.autocast_context():
                value = objective(inputs, labels)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()

    speed = timed(step, steps, batch)
    result = {
        **row,
        "img_per_s": speed,
        "bf16_used": compute.autocast is not None,
        "peak_rss_mb": peak_rss_mb(),
    }
    if mode == "finetune":
        result["chunk"] = chunk
    return result


MODES = ("frozen-extract", "partial", "finetune")


def plan(batches: list[int], memory_batch: int, finetune_size: int, modes: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for mode in modes:
        size = finetune_size if mode == "finetune" else EXTRACT_SIZE
        for batch in batches:
            rows += [{"mode": mode, "setting": s, "batch": batch, "size": size} for s in SETTINGS]
            if mode == "frozen-extract":
                rows.append({"mode": mode, "setting": "onnxruntime", "batch": batch, "size": size})
    # The memory goal at the recipe's batch: default chunks, and the whole batch at once, in both precisions.
    default_chunk = TrainConfig.model_fields["backbone_chunk"].default
    for setting in ("fp32", "channels_last+bf16") if "finetune" in modes else ():
        for chunk in (default_chunk, 0):
            row = {"mode": "finetune", "setting": setting, "batch": memory_batch, "size": finetune_size}
            rows.append({**row, "chunk": chunk})
    return rows


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Against float32 at the same mode, batch and chunks (every finetune row records its chunks).
    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return row["mode"], row["batch"], row.get("chunk")

    base = {key(r): r["img_per_s"] for r in rows if r["setting"] == "fp32"}
    for row in rows:
        reference = base.get(key(row))
        row["speedup"] = round(row["img_per_s"] / reference, 2) if reference else None
        row["img_per_s"] = round(row["img_per_s"], 1)
        row["peak_rss_mb"] = round(row["peak_rss_mb"])
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Training speed and memory (`bench/train_speed.py`)",
        "",
        f"`{meta['command']}`",
        "",
        f"CPU: {meta['cpu']}; native bfloat16: {meta['native_bf16']}; torch threads {meta['threads']} "
        f"(OMP_WAIT_POLICY={meta['omp_wait_policy']}); "
        f"load average before the run {meta['load_before']}. img/s over {meta['steps']} steps after one "
        "warm-up step, random images; peak RSS of the row's own process.",
        "",
        "| mode | setting | batch | px | chunk | bf16 used | img/s | speedup | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["mode"], r["setting"], r["batch"], r["size"], r.get("chunk", "-"), r["bf16_used"]]
        cells += [r["img_per_s"], "-" if r["speedup"] is None else r["speedup"], r["peak_rss_mb"]]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, threads_option(2), out_option(Path("bench/results/train_speed")))
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--memory-batch", type=int, default=128)
    parser.add_argument(
        "--finetune-size",
        type=int,
        default=FINETUNE["train_size"].value,
        help="crop size of the finetune rows (default: the fine-tuning recipe's train_size)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the rows to run")
    parser.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OpenMP wait policy of the rows' processes: on a shared, loaded machine ACTIVE threads spin on "
        "cores others need (Lite0 forward at 2 threads, load 12: 0.8-1.2 img/s ACTIVE, 6-9 PASSIVE)",
    )
    parser.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: where the CPU has it natively; on: emulated elsewhere; off: as a CPU without it",
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row as JSON, in a child process
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row), args.steps, args.bf16)))
        return

    meta = {
        "command": "python " + " ".join(sys.argv),
        "cpu": _cpu_name(),
        "native_bf16": cpu_has_native_bf16(),
        "threads": args.threads,
        "omp_wait_policy": args.omp_wait_policy,
        "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "steps": args.steps,
        "torch": torch.__version__,
    }
    rows = []
    for row in plan(args.batches, args.memory_batch, args.finetune_size, args.modes):
        child = [sys.executable, __file__, "--row", json.dumps(row), "--steps", str(args.steps)]
        child += ["--threads", str(args.threads), "--bf16", args.bf16]
        env = {**os.environ, "OMP_WAIT_POLICY": args.omp_wait_policy}
        done = subprocess.run(child, check=True, capture_output=True, text=True, env=env)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    meta["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = with_speedups(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
