"""Perceptual signatures tell copies of a photo from another photo, on real encoded files, and build-index
stores the signature its decode workers computed for every item."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from engine.build.indexing import build_index
from engine.decode.images import decode_image
from engine.duplicates.groups import DEFAULT_MAX_DISTANCE, signature_distance
from engine.duplicates.signature import TURNS, perceptual_signature
from engine.duplicates.signature_layout import views_of
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex


def encoded(image: Image.Image, fmt: str, **save_args: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


def copies(photo: Image.Image) -> dict[str, bytes]:
    """The kinds of copy bench/duplicates.py measures, plus quarter turns and a 12-MP JPEG (decoded with
    the JPEG draft).

    Crops other than about 90% centred are not among them: the signature's views do not cover them, and
    only the embedding's cosine can join those (see engine.duplicates.signature)."""
    width, height = photo.size
    return {
        "reencoded": encoded(photo, "JPEG", quality=60),
        "resized": encoded(photo.resize((width // 2, height // 2), Image.Resampling.LANCZOS), "PNG"),
        "cropped90": encoded(
            photo.crop((width // 20, height // 20, width - width // 20, height - height // 20)), "JPEG"
        ),
        "mirrored": encoded(ImageOps.mirror(photo), "PNG"),
        "brighter15": encoded(ImageEnhance.Brightness(photo).enhance(1.15), "JPEG", quality=90),
        "darker15": encoded(ImageEnhance.Brightness(photo).enhance(0.85), "WEBP", quality=90),
        "turned90": encoded(photo.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=90),
        "turned180": encoded(photo.transpose(Image.Transpose.ROTATE_180), "PNG"),
        "turned270": encoded(photo.transpose(Image.Transpose.ROTATE_270), "WEBP", quality=90),
        "upscaled_12mp": encoded(photo.resize((4000, 3000), Image.Resampling.BICUBIC), "JPEG", quality=92),
    }


def signature_of(data: bytes) -> np.ndarray:
    """The signature as build-index computes it: from the image decoded with the JPEG draft."""
    image = decode_image(data, draft_size=224)
    return np.frombuffer(views_of(perceptual_signature(image)), dtype=np.uint64).reshape(1, -1)


def bits(first: bytes, second: bytes) -> int:
    return int(signature_distance(signature_of(first), signature_of(second))[0])


@pytest.mark.parametrize("photo_name", ["cat/00_original.jpg", "astronaut/02_original.jpg"])
def test_copies_are_within_the_distance_and_other_photos_are_not(demo_gallery: Path, photo_name: str) -> None:
    original = (demo_gallery / photo_name).read_bytes()
    photo = decode_image(original)
    for kind, copy in copies(photo).items():
        distance = bits(original, copy)
        assert distance <= DEFAULT_MAX_DISTANCE, (kind, distance)
        assert bits(copy, original) == distance  # symmetric
    for other in sorted(demo_gallery.glob("*/*_original.jpg")):
        if other.relative_to(demo_gallery).as_posix() != photo_name:
            assert bits(original, other.read_bytes()) > DEFAULT_MAX_DISTANCE, other.name


def test_the_signature_has_the_photo_first_then_its_mirror_crop_and_turned_views(demo_gallery: Path) -> None:
    photo = decode_image((demo_gallery / "cat/00_original.jpg").read_bytes())
    views = np.frombuffer(views_of(perceptual_signature(photo)), dtype=np.uint64)
    mirrored = np.frombuffer(views_of(perceptual_signature(ImageOps.mirror(photo))), dtype=np.uint64)
    assert len(views) == 7 and views[0] == mirrored[1] and views[1] == mirrored[0]
    # The turned views are the turned images' own views (the cat is not square: the thumbnail is squashed).
    for position, turn in zip(range(4, 7), TURNS, strict=True):
        turned = np.frombuffer(views_of(perceptual_signature(photo.transpose(turn))), dtype=np.uint64)
        assert np.bitwise_count(turned[0] ^ views[position]) <= 2, turn


def test_build_index_stores_each_items_signature(
    demo_gallery: Path, exported_model: Path, tmp_path: Path
) -> None:
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    for path in sorted(demo_gallery.glob("*/0[01]_original.jpg")):
        (gallery / path.name).write_bytes(path.read_bytes())
    build_index(gallery, Embedder(exported_model, threads=1), tmp_path / "index", progress=False)
    index = GalleryIndex.open(tmp_path / "index")
    stored = index.signatures()
    items = list(index.items.scan())
    index.close()
    assert sorted(stored) == sorted(item.id for item in items)
    for item in items:
        data = (gallery / item.path).read_bytes()
        assert stored[item.id] == perceptual_signature(decode_image(data, draft_size=224))
