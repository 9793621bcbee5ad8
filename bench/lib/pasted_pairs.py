"""The explanation benches' pairs (bench/explain_pointing.py, bench/explain_variants.py): an object pasted
into two scenes, where its box is in each, and where an explanation's peak lands against it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image

from engine.gallery.demo import PHOTOS
from engine.model.embedder import Embedder
from engine.model.explainer import Explainer
from engine.serve.explain import Peak, window_sums
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
