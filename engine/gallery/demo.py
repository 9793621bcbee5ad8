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


# Licences as the packages that ship the photos state them (scikit-image's data docstrings, scikit-learn's
# datasets/images/README.txt), checked in scikit-image 0.26.0 and scikit-learn as installed.
SKIMAGE_MOTORCYCLE = (
    "none stated for the image itself: scikit-image's docstring credits the Middlebury 2014 stereo "
    "benchmark (N. Nesic, P. Westling, X. Wang, Y. Kitajima, G. Krathwohl, D. Scharstein; GCPR 2014) and "
    "names no licence; its LICENSE.txt gives BSD-3-Clause for all the package's files (`Files: *`)"
)
PHOTOS = [
    DemoPhoto(
        "cat",
        _skimage("chelsea"),
        "scikit-image data.chelsea (Stefan van der Walt)",
        "CC0 (by the photographer)",
    ),
    DemoPhoto(
        "coffee",
        _skimage("coffee"),
        "scikit-image data.coffee (Rachel Michetti)",
        "CC0 (by the photographer)",
    ),
    DemoPhoto(
        "astronaut",
        _skimage("astronaut"),
        "scikit-image data.astronaut (NASA Great Images, https://flic.kr/p/r9qvLn)",
        "public domain (no known copyright restrictions)",
    ),
    DemoPhoto(
        "rocket",
        _skimage("rocket"),
        "scikit-image data.rocket (SpaceX, https://www.flickr.com/photos/spacexphotos/16511594820/)",
        "public domain (released by SpaceX)",
    ),
    DemoPhoto(
        "galaxies",
        _skimage("hubble_deep_field"),
        "scikit-image data.hubble_deep_field (NASA, HubbleSite release 2012-37)",
        "public domain (NASA: may be freely used)",
    ),
    DemoPhoto(
        "retina",
        _skimage("retina"),
        "scikit-image data.retina (Mikael Häggström, Wikimedia Commons)",
        "CC0 1.0 Universal Public Domain Dedication",
    ),
    DemoPhoto("brick", _skimage("brick"), "scikit-image data.brick (CC0Textures, Bricks25)", "CC0"),
    DemoPhoto("grass", _skimage("grass"), "scikit-image data.grass (linolafett, DeviantArt)", "CC0"),
    DemoPhoto("gravel", _skimage("gravel"), "scikit-image data.gravel (CC0Textures, Gravel04)", "CC0"),
    DemoPhoto(
        "motorcycle",
        _motorcycle(0),
        "scikit-image data.stereo_motorcycle, left view (Middlebury 2014 stereo, downsampled 4x)",
        SKIMAGE_MOTORCYCLE,
    ),
    DemoPhoto(
        "motorcycle",
        _motorcycle(1),
        "scikit-image data.stereo_motorcycle, right view (Middlebury 2014 stereo, downsampled 4x)",
        SKIMAGE_MOTORCYCLE,
    ),
    DemoPhoto(
        "temple",
        _sklearn("china.jpg"),
        "scikit-learn china.jpg (danielbuechele, https://www.flickr.com/photos/danielbuechele/6061409035/)",
        "CC BY 2.0 (https://creativecommons.org/licenses/by/2.0/)",
    ),
    DemoPhoto(
        "flower",
        _sklearn("flower.jpg"),
        "scikit-learn flower.jpg (vultilion, https://www.flickr.com/photos/vultilion/6056698931/)",
        "CC BY 2.0 (https://creativecommons.org/licenses/by/2.0/)",
    ),
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
    licence_lines = [
        "# Demo gallery sources and licences",
        "",
        "Each photo is here as shipped (`*_original.jpg`, re-encoded as JPEG) and as variants made from it",
        "for this demo (`mirror`, `crop`, `rotated`, `warm`: brightness and colour, `small`: half size).",
        "",
    ]
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
