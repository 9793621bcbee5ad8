"""Recall@1/2/4/8 (and MAP@R) of an exported ONNX model with the deep-metric-learning protocol.

    python bench/retrieval.py --data CARS196/images [--model model.onnx] [--split test]

The data is an ImageFolder-style directory or a ``path,label[,split]`` CSV. Classes are split as in the
papers (first half train, second half test; see ``training.data.split_classes``) and every image of the
chosen split is a query against all the others. Without ``--model`` the pretrained backbone is exported
to a temporary directory first. Unreadable images are skipped with a warning.
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from lib.options import bench_parser, data_option, model_option, threads_option
from tqdm import tqdm

from engine.decode.images import ImageDecodeError, load_image_file
from engine.model.embedder import Embedder
from training.data import load_labelled_images, split_classes
from training.features import backbone_model
from training.metrics import evaluate


def embed_files(embedder: Embedder, files: list[Path], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings of the readable files and the mask of which files were readable."""
    draft_size = embedder.card.preprocessing.resize_size
    vectors, ok = [], np.zeros(len(files), dtype=bool)
    for start in tqdm(range(0, len(files), batch_size), desc="embedding", unit="batch"):
        images = []
        for row in range(start, min(start + batch_size, len(files))):
            try:
                images.append(load_image_file(files[row], draft_size=draft_size))
                ok[row] = True
            except (ImageDecodeError, OSError) as err:
                warnings.warn(f"skipped {files[row]}: {err}", stacklevel=1)
        vectors.append(embedder.embed(images))
    return np.concatenate(vectors), ok


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option(),
        model_option(),
        threads_option(0),
    )
    parser.add_argument("--split", choices=("train", "val", "test"), default="test")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--clustering", action="store_true", help="also NMI and F1 of k-means")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()

    data = load_labelled_images(args.data)
    indices = split_classes(data)[args.split]
    with tempfile.TemporaryDirectory() as workdir:
        model = args.model or backbone_model(Path(workdir), "efficientnet_lite0")
        embedder = Embedder(model, threads=args.threads)
        started = time.perf_counter()
        vectors, ok = embed_files(embedder, data.files(indices), args.batch_size)
        seconds = time.perf_counter() - started
    labels = data.labels[indices][ok]
    metrics = evaluate(vectors, labels, clustering=args.clustering)
    result = {
        "model": str(args.model or "pretrained efficientnet_lite0"),
        "fingerprint": embedder.fingerprint,
        "data": str(args.data),
        "split": args.split,
        "images": int(ok.sum()),
        "skipped": int((~ok).sum()),
        "classes": len(np.unique(labels)),
        "embed_seconds": round(seconds, 1),
        **{name: round(100 * value, 2) for name, value in metrics.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
