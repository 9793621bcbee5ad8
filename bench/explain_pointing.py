"""Does the heatmap point at the right place? One object pasted into two different backgrounds: the peak of
each image's heatmap (``engine.explain``) should fall inside the pasted object's box.

    python bench/explain_pointing.py [--model MODEL] [--pairs 240] [--seed 0]
                                     [--out bench/results/explain_pointing.json]

Objects and backgrounds are the demo gallery's source photos (``engine.demo_gallery.PHOTOS``: real photos
shipped in scikit-image and scikit-learn). Per pair: a random square crop of one photo, resized to 56-96
px, is pasted at random places into random 224 x 224 crops of two other photos (the model sees all of a
224-pixel square image). Baselines: a random peak (the fraction of grid cells whose centre lies in the box,
its exact expectation) and the image centre. Without ``--model`` the pretrained model is exported first.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from explain_cost import pretrained_model  # bench/ scripts run from bench/ on sys.path
from PIL import Image

from engine.demo_gallery import PHOTOS
from engine.embedder import Embedder
from engine.explain import explain_tensor
from engine.explainer import Explainer
from index.atomic import atomic_write_text

SIDE = 224


def random_crop(
    photo: Image.Image, side: int, rng: np.random.Generator, scale: tuple[float, float]
) -> Image.Image:
    crop = int(min(photo.size) * rng.uniform(*scale))
    left = int(rng.integers(0, photo.width - crop + 1))
    top = int(rng.integers(0, photo.height - crop + 1))
    return photo.crop((left, top, left + crop, top + crop)).resize((side, side), Image.Resampling.BICUBIC)


def pasted(
    background: Image.Image, thing: Image.Image, rng: np.random.Generator
) -> tuple[Image.Image, tuple]:
    x = int(rng.integers(0, SIDE - thing.width + 1))
    y = int(rng.integers(0, SIDE - thing.height + 1))
    image = background.copy()
    image.paste(thing, (x, y))
    return image, (x, y, x + thing.width, y + thing.height)


def cell_centres(grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    rows, columns = grid
    ys = (np.arange(rows) + 0.5) * SIDE / rows
    xs = (np.arange(columns) + 0.5) * SIDE / columns
    return np.meshgrid(ys, xs, indexing="ij")


def inside(box: tuple, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    x0, y0, x1, y1 = box
    return (xs >= x0) & (xs < x1) & (ys >= y0) & (ys < y1)


def run(model: Path, pairs: int, seed: int) -> dict:
    embedder = Embedder(model, threads=0)
    bundle = SimpleNamespace(embedder=embedder, explainer=Explainer.for_model(model, embedder.card))
    if bundle.explainer is None:
        raise SystemExit(f"{model} has no explainer: re-export it")
    photos = [Image.fromarray(photo.load()).convert("RGB") for photo in PHOTOS]
    rng = np.random.default_rng(seed)
    hits = {"peak": np.zeros((pairs, 2), bool), "centre": np.zeros((pairs, 2), bool)}
    random_peak = np.zeros((pairs, 2))
    for pair in range(pairs):
        source, *backgrounds = rng.choice(len(photos), size=3, replace=False)
        thing = random_crop(photos[source], int(rng.integers(56, 97)), rng, (0.3, 0.6))
        images, boxes = zip(
            *(pasted(random_crop(photos[b], SIDE, rng, (0.5, 1.0)), thing, rng) for b in backgrounds),
            strict=True,
        )
        _, grids, _ = explain_tensor(bundle, embedder.preprocess(list(images)))
        ys, xs = cell_centres(grids[0].shape)
        centre = (np.array([SIDE / 2]), np.array([SIDE / 2]))
        for side, (grid, box) in enumerate(zip(grids, boxes, strict=True)):
            peak = np.unravel_index(int(np.argmax(grid)), grid.shape)
            hits["peak"][pair, side] = inside(box, ys, xs)[peak]
            hits["centre"][pair, side] = inside(box, *centre)[0]
            random_peak[pair, side] = inside(box, ys, xs).mean()
    return {
        "model": str(model),
        "pairs": pairs,
        "seed": seed,
        "peak_in_box": {
            "query": hits["peak"][:, 0].mean(),
            "item": hits["peak"][:, 1].mean(),
            "both": hits["peak"].all(1).mean(),
        },
        "random_peak_in_box": {"query": random_peak[:, 0].mean(), "item": random_peak[:, 1].mean()},
        "centre_in_box": {"query": hits["centre"][:, 0].mean(), "item": hits["centre"][:, 1].mean()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path)
    parser.add_argument("--pairs", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or pretrained_model(Path(folder))
        result = run(model, args.pairs, args.seed)
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if args.out:
        atomic_write_text(args.out.with_suffix(".json"), text + "\n")


if __name__ == "__main__":
    main()
