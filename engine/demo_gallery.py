"""A small demo gallery assembled from photos that ship, under permissive licences, inside PyPI packages.

Each source photo becomes one class folder holding the photo and a few deterministic variants (crops,
mirror image, rotation, colour and scale changes), so that retrieval has true neighbours to find.
Nothing is downloaded; nothing is copied from private data sets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance, ImageOps


@dataclass(frozen=True)
class DemoPhoto:
    label: str
    load: Callable[[], np.ndarray]
    source: str
    licence: str


def _skimage(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return getattr(skimage.data, name)()

    return load


def _motorcycle(view: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return skimage.data.stereo_motorcycle()[view]

    return load


def _sklearn(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from sklearn.datasets import load_sample_image

        return load_sample_image(name)

    return load


PHOTOS = [
    DemoPhoto("cat", _skimage("chelsea"), "scikit-image data.chelsea (Stefan van der Walt)", "CC0"),
    DemoPhoto("coffee", _skimage("coffee"), "scikit-image data.coffee (Rachel Michetti)", "CC0"),
    DemoPhoto("astronaut", _skimage("astronaut"), "scikit-image data.astronaut (NASA)", "public domain"),
    DemoPhoto("rocket", _skimage("rocket"), "scikit-image data.rocket (SpaceX)", "public domain (CC0)"),
    DemoPhoto(
        "galaxies",
        _skimage("hubble_deep_field"),
        "scikit-image data.hubble_deep_field (NASA)",
        "public domain",
    ),
    DemoPhoto("retina", _skimage("retina"), "scikit-image data.retina (Mikael Häggström)", "CC0"),
    DemoPhoto("brick", _skimage("brick"), "scikit-image data.brick (CC0Textures)", "CC0"),
    DemoPhoto("grass", _skimage("grass"), "scikit-image data.grass (linolafett)", "CC0"),
    DemoPhoto("gravel", _skimage("gravel"), "scikit-image data.gravel (CC0Textures)", "CC0"),
    DemoPhoto(
        "motorcycle",
        _motorcycle(0),
        "scikit-image data.stereo_motorcycle, left view (Middlebury)",
        "see scikit-image",
    ),
    DemoPhoto(
        "motorcycle",
        _motorcycle(1),
        "scikit-image data.stereo_motorcycle, right view (Middlebury)",
        "see scikit-image",
    ),
    DemoPhoto(
        "temple", _sklearn("china.jpg"), "scikit-learn china.jpg (danielbuechele, Flickr)", "CC BY 2.0"
    ),
    DemoPhoto("flower", _sklearn("flower.jpg"), "scikit-learn flower.jpg (vultilion, Flickr)", "CC BY 2.0"),
]


def _variants(image: Image.Image) -> dict[str, Image.Image]:
    width, height = image.size
    return {
        "original": image,
        "mirror": ImageOps.mirror(image),
        "crop": image.crop((width // 10, height // 10, width - width // 10, height - height // 10)),
        "rotated": image.rotate(
            8, resample=Image.Resampling.BICUBIC, expand=False, fillcolor=(128, 128, 128)
        ),
        "warm": ImageEnhance.Color(ImageEnhance.Brightness(image).enhance(1.15)).enhance(1.4),
        "small": image.resize((max(1, width // 2), max(1, height // 2)), Image.Resampling.LANCZOS),
    }


def write_demo_gallery(out: Path) -> int:
    """Write the gallery to ``out/<label>/<name>.jpg`` plus ``LICENSES.md``; returns the image count."""
    count = 0
    licence_lines = ["# Demo gallery sources and licences", ""]
    for index, photo in enumerate(PHOTOS):
        array = photo.load()
        if array.dtype == bool:
            array = array.astype(np.uint8) * 255
        image = Image.fromarray(array).convert("RGB")
        folder = out / photo.label
        folder.mkdir(parents=True, exist_ok=True)
        for name, variant in _variants(image).items():
            variant.save(folder / f"{index:02d}_{name}.jpg", quality=92)
            count += 1
        licence_lines.append(f"- `{photo.label}/{index:02d}_*.jpg`: {photo.source}; licence: {photo.licence}")
    (out / "LICENSES.md").write_text("\n".join(licence_lines) + "\n")
    return count
