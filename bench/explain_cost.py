"""What one explanation costs against one query's embedding, on the CPU, in one run (a ratio).

    python bench/explain_cost.py [--model artifacts/model/model.onnx] [--threads 1] [--repeats 20] [--noise]

Both start from decoded, preprocessed images: a query embeds one image; an explanation embeds the query
and the result in one batch with the feature maps, runs the explainer, takes both heatmaps and their
peaks and draws both overlays as JPEG (what ``/v1/explain`` does after decoding). The pair is two
demo-gallery photos (``engine.gallery.demo.PHOTOS``: the cat and the coffee); with ``--noise`` two images
of Gaussian noise, the worst case for the encoder (the first runs' input). Each figure is the minimum over
``--repeats`` runs after a warm-up, so that other load on the machine inflates it as little as possible.
Without ``--model`` the pretrained model is exported to a temporary folder first.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from lib.options import bench_parser, model_option, threads_option
from PIL import Image

from engine.gallery.demo import PHOTOS
from engine.model.embedder import Embedder
from engine.model.explainer import Explainer
from engine.serve.explain import Heatmap, explain_tensor, model_view
from engine.serve.heatmap_image import jpeg_bytes, overlay
from foundation.defaults import BACKBONE
from training.features import backbone_model


def best_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return 1000 * min(timings)


def photo_pair(embedder: Embedder) -> np.ndarray:
    photos = [Image.fromarray(photo.load()).convert("RGB") for photo in PHOTOS[:2]]
    return embedder.preprocess(photos)


def measure(model: Path, threads: int, repeats: int, noise: bool = False) -> dict[str, float]:
    embedder = Embedder(model, threads=threads)
    bundle = SimpleNamespace(
        embedder=embedder, explainer=Explainer.for_model(model, embedder.card, threads=threads)
    )
    size = embedder.card.preprocessing.input_size
    pair = (
        np.random.default_rng(0).normal(size=(2, 3, size, size)).astype(np.float32)
        if noise
        else photo_pair(embedder)
    )

    def explain() -> list[bytes]:
        _, grids, rests, peaks = explain_tensor(bundle, pair)
        views = [model_view(image, embedder.card.preprocessing) for image in pair]
        heatmaps = map(Heatmap, grids, rests, views, peaks)
        return [jpeg_bytes(overlay(heatmap)) for heatmap in heatmaps]

    query_ms = best_ms(lambda: embedder.embed_tensor(pair[:1]), repeats)
    heatmaps_ms = best_ms(lambda: explain_tensor(bundle, pair), repeats)  # grids and peaks, no drawing
    explain_ms = best_ms(explain, repeats)
    return {
        "query_embedding_ms": query_ms,
        "heatmaps_ms": heatmaps_ms,
        "explanation_with_overlays_ms": explain_ms,
        "heatmaps_ratio": heatmaps_ms / query_ms,
        "explanation_ratio": explain_ms / query_ms,
    }


def main() -> None:
    parser = bench_parser(__doc__, model_option(), threads_option(1))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--noise", action="store_true", help="two noise images instead of two photos")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or backbone_model(Path(folder), BACKBONE)
        result = measure(model, args.threads, args.repeats, args.noise)
    pair = "noise" if args.noise else "photos"
    print(json.dumps({"threads": args.threads, "repeats": args.repeats, "pair": pair, **result}, indent=2))


if __name__ == "__main__":
    main()
