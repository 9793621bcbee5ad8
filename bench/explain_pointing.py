"""Does the heatmap point at the right place? One object pasted into two different backgrounds: the peak of
each image's heatmap (``engine.serve.explain``) should fall inside the pasted object's box.

    python bench/explain_pointing.py [--model MODEL] [--pairs 240] [--seed 0] [--any-photos]
                                     [--objects FOLDER] [--out bench/results/explain_pointing.json]

Objects and backgrounds are the demo gallery's source photos (``engine.gallery.demo.PHOTOS``: real photos
shipped in scikit-image and scikit-learn). Per pair: a random square crop of one photo, resized to 56-96
px, is pasted at random places into random 224 x 224 crops of two other photos (the model sees all of a
224-pixel square image). The three photos show three different scenes (labels): the two views of the
stereo motorcycle are one scene, so they are never the two "different" backgrounds, nor an object and its
background. ``--any-photos`` draws three different photos instead (the first runs' protocol, where 3-6%
of pairs had the same scene twice). ``--objects FOLDER`` takes the objects from other photos, none seen
while the peak was chosen: the centre square (30-60% of the short side) of a random image under FOLDER
(e.g. Cars196's images, whose cars fill the centre), pasted into two demo scenes. Three peaks of each
image are scored, each counted inside when its centre lies in the pasted box:

- ``matched``, the served one (``engine.serve.explain.matched_windows``): the 3 x 3 windows of grid positions,
  one in each image, whose pairs of positions point most alike (the cosine of their contributions),
  beyond how alike each is to the other image's positions on average;
- ``window``: the 3 x 3 window of the image's own heatmap whose shares add up to the most;
- ``position``: the single grid position with the largest share.

Baselines: a random peak of each size (the fraction of windows, or positions, whose centre lies in the
box: its exact expectation) and the image centre. Without ``--model`` the pretrained model is exported
first.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from explain_cost import pretrained_model  # bench/ scripts run from bench/ on sys.path
from PIL import Image

from engine.gallery.demo import PHOTOS
from engine.model.embedder import Embedder
from engine.model.explainer import Explainer
from engine.serve.explain import Peak, explain_tensor, window_sums
from foundation.atomic import atomic_write_text
from foundation.defaults import EXPLAIN_PEAK_POSITIONS

SIDE = 224
SIZES = {"matched": EXPLAIN_PEAK_POSITIONS, "window": EXPLAIN_PEAK_POSITIONS, "position": 1}


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


def centre(peak: Peak, grid: tuple[int, int]) -> tuple[float, float]:
    x0, y0, x1, y1 = peak.box(grid, (SIDE, SIDE))
    return (x0 + x1) / 2, (y0 + y1) / 2


def inside(box: tuple, point: tuple[float, float]) -> bool:
    x0, y0, x1, y1 = box
    x, y = point
    return x0 <= x < x1 and y0 <= y < y1


def heatmap_peak(grid: np.ndarray, size: int) -> Peak:
    """The ``size`` x ``size`` window of one heatmap whose shares add up to the most."""
    sums = window_sums(grid, size)
    top, left = np.unravel_index(int(np.argmax(sums)), sums.shape)
    return Peak(int(top), int(left), size, float(sums[top, left]))


def random_peak_in_box(box: tuple, grid: np.ndarray, size: int) -> float:
    """The chance that a peak of ``size`` x ``size`` positions, placed at random, falls inside ``box``."""
    rows, columns = grid.shape[0] - size + 1, grid.shape[1] - size + 1
    peaks = [Peak(top, left, size, 0.0) for top in range(rows) for left in range(columns)]
    return float(np.mean([inside(box, centre(peak, grid.shape)) for peak in peaks]))


def three_scenes(rng: np.random.Generator, any_photos: bool) -> list[int]:
    """The photos (indices of ``PHOTOS``) of the object and the two backgrounds of one pair."""
    if any_photos:
        return [int(i) for i in rng.choice(len(PHOTOS), size=3, replace=False)]
    labels = sorted({photo.label for photo in PHOTOS})
    chosen = rng.choice(len(labels), size=3, replace=False)
    photos = [[i for i, photo in enumerate(PHOTOS) if photo.label == labels[c]] for c in chosen]
    return [int(rng.choice(of_scene)) for of_scene in photos]


def centre_crop(photo: Image.Image, side: int, rng: np.random.Generator) -> Image.Image:
    crop = int(min(photo.size) * rng.uniform(0.3, 0.6))
    left, top = (photo.width - crop) // 2, (photo.height - crop) // 2
    return photo.crop((left, top, left + crop, top + crop)).resize((side, side), Image.Resampling.BICUBIC)


def pasted_pairs(
    pairs: int, seed: int, any_photos: bool = False, objects: Path | None = None
) -> Iterator[tuple[list[Image.Image], tuple[tuple, tuple]]]:
    """Each pair's two images and the pasted object's box ``(x0, y0, x1, y1)`` in each."""
    photos = [Image.fromarray(photo.load()).convert("RGB") for photo in PHOTOS]
    object_files = sorted(objects.rglob("*.jpg")) if objects else []
    rng = np.random.default_rng(seed)
    for _ in range(pairs):
        source, *backgrounds = three_scenes(rng, any_photos)
        side = int(rng.integers(56, 97))
        if object_files:
            other = object_files[int(rng.integers(len(object_files)))]
            thing = centre_crop(Image.open(other).convert("RGB"), side, rng)
        else:
            thing = random_crop(photos[source], side, rng, (0.3, 0.6))
        images, boxes = zip(
            *(pasted(random_crop(photos[b], SIDE, rng, (0.5, 1.0)), thing, rng) for b in backgrounds),
            strict=True,
        )
        yield list(images), boxes


def explainable_bundle(model: Path) -> SimpleNamespace:
    """What ``engine.serve.explain.explain_tensor`` needs of a served bundle: the embedder and the
    explainer."""
    embedder = Embedder(model, threads=0)
    bundle = SimpleNamespace(embedder=embedder, explainer=Explainer.for_model(model, embedder.card))
    if bundle.explainer is None:
        raise SystemExit(f"{model} has no explainer: re-export it")
    return bundle


def run(model: Path, pairs: int, seed: int, any_photos: bool = False, objects: Path | None = None) -> dict:
    bundle = explainable_bundle(model)
    hits = {kind: np.zeros((pairs, 2), bool) for kind in SIZES}
    random_peak = {size: np.zeros((pairs, 2)) for size in set(SIZES.values())}
    at_centre = np.zeros((pairs, 2), bool)
    for pair, (images, boxes) in enumerate(pasted_pairs(pairs, seed, any_photos, objects)):
        _, grids, _, matched = explain_tensor(bundle, bundle.embedder.preprocess(images))
        for side, (grid, box) in enumerate(zip(grids, boxes, strict=True)):
            peaks = {
                "matched": matched[side],
                "window": heatmap_peak(grid, SIZES["window"]),
                "position": heatmap_peak(grid, SIZES["position"]),
            }
            for kind, peak in peaks.items():
                hits[kind][pair, side] = inside(box, centre(peak, grid.shape))
            for size, chance in random_peak.items():
                chance[pair, side] = random_peak_in_box(box, grid, size)
            at_centre[pair, side] = inside(box, (SIDE / 2, SIDE / 2))
    return {
        "model": str(model),
        "pairs": pairs,
        "seed": seed,
        "scenes": "any three photos" if any_photos else "three different scenes",
        "objects": str(objects) if objects else "demo photos",
        "peak_in_box": {
            kind: {"query": hit[:, 0].mean(), "item": hit[:, 1].mean(), "both": hit.all(1).mean()}
            for kind, hit in hits.items()
        },
        "random_peak_in_box": {
            f"{size}x{size}": {"query": chance[:, 0].mean(), "item": chance[:, 1].mean()}
            for size, chance in sorted(random_peak.items())
        },
        "centre_in_box": {"query": at_centre[:, 0].mean(), "item": at_centre[:, 1].mean()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path)
    parser.add_argument("--pairs", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--any-photos", action="store_true", help="the first runs' protocol (see above)")
    parser.add_argument("--objects", type=Path, help="take the objects from the images (*.jpg) under it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or pretrained_model(Path(folder))
        result = run(model, args.pairs, args.seed, args.any_photos, args.objects)
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if args.out:
        atomic_write_text(args.out.with_suffix(".json"), text + "\n")


if __name__ == "__main__":
    main()
