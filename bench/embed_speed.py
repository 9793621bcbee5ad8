"""Per-image embedding time: torch eager vs onnxruntime, batch 1 and 32, same model, same run.

    python bench/embed_speed.py [--threads 2] [--repeats 5]

Both runtimes use the same thread count. Each figure is the minimum over ``--repeats`` timed runs
after a warm-up, so that other load on the machine inflates it as little as possible.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine.embedder import Embedder
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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = EmbeddingModel(create_backbone("efficientnet_lite0")).eval()
    with tempfile.TemporaryDirectory() as workdir:
        model_path = Path(workdir) / "model.onnx"
        export_onnx(
            model,
            model_path,
            preprocessing=BACKBONES["efficientnet_lite0"].preprocessing,
            backbone="efficientnet_lite0",
        )
        embedder = Embedder(model_path, threads=args.threads)
        print(f"threads={args.threads} repeats={args.repeats} (min per configuration)")
        print(f"{'batch':>5}  {'torch eager ms/img':>18}  {'onnxruntime ms/img':>18}  {'speed-up':>8}")
        for batch_size in (1, 32):
            batch = np.random.default_rng(0).standard_normal((batch_size, 3, 224, 224)).astype(np.float32)
            tensor = torch.from_numpy(batch)

            def run_torch(tensor: torch.Tensor = tensor) -> object:
                with torch.inference_mode():
                    return model(tensor)

            torch_ms = best_seconds(run_torch, args.repeats) * 1000 / batch_size
            ort_ms = (
                best_seconds(lambda batch=batch: embedder.embed_tensor(batch), args.repeats)
                * 1000
                / batch_size
            )
            print(f"{batch_size:>5}  {torch_ms:>18.2f}  {ort_ms:>18.2f}  {torch_ms / ort_ms:>7.2f}x")


if __name__ == "__main__":
    main()
