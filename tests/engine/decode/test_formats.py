"""Phone and web formats from real encoders: HEIC, AVIF, WebP, animations, EXIF orientation, sniffing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image, features

from bench.lib.images import image_bytes, make_image
from engine.build.indexing import build_index
from engine.decode.images import decode_image, open_image
from engine.gallery.files import list_images
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex

# Formats whose encoder writes EXIF (GIF and BMP have no EXIF). Pillow's AVIF encoder needs libavif.
EXIF_FORMATS = ["HEIF", "AVIF", "WEBP", "JPEG", "PNG", "TIFF"]
ANIMATED_FORMATS = ["GIF", "WEBP", "HEIF", "AVIF"]


def _skip_without(fmt: str) -> None:
    if fmt == "AVIF" and not features.check("avif"):
        pytest.skip("this Pillow was built without libavif")


def _picture() -> Image.Image:
    """A landscape picture whose orientation is unmistakable: a white left third on a generated photo."""
    image = make_image(7, size=(120, 80))
    image.paste((255, 255, 255), (0, 0, 40, 80))
    return image


def _difference(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float32) - np.asarray(b, dtype=np.float32)).mean())


@pytest.mark.parametrize("fmt", EXIF_FORMATS)
def test_exif_orientation_is_applied_in_every_format(fmt: str) -> None:
    _skip_without(fmt)
    picture = _picture()
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, displayed rotated 90 degrees clockwise
    decoded = decode_image(image_bytes(picture, fmt, exif=exif.tobytes(), quality=95))
    upright = picture.transpose(Image.Transpose.ROTATE_270)
    assert decoded.mode == "RGB" and decoded.size == upright.size == (80, 120)
    # Lossy encoders change pixels a little; the wrong rotation (upside down) changes them a lot.
    assert _difference(decoded, upright) < 8
    assert _difference(decoded, picture.transpose(Image.Transpose.ROTATE_90)) > 40


@pytest.mark.parametrize("fmt", ANIMATED_FORMATS)
def test_animations_and_image_sequences_use_their_first_frame(fmt: str) -> None:
    _skip_without(fmt)
    red, blue = Image.new("RGB", (64, 48), (220, 20, 20)), Image.new("RGB", (64, 48), (20, 20, 220))
    data = image_bytes(red, fmt, save_all=True, append_images=[blue], duration=100, quality=95)
    reopened = open_image(data)
    assert getattr(reopened, "n_frames", 1) == 2  # really a two-frame file
    decoded = np.asarray(decode_image(data), dtype=np.float32)
    assert np.abs(decoded - np.asarray(red, dtype=np.float32)).mean() < 10


def test_files_are_recognised_by_content_not_by_name(tmp_path: Path, exported_model: Path) -> None:
    gallery = tmp_path / "gallery"
    (gallery / "cars").mkdir(parents=True)
    (gallery / "cars" / "really_a_png.jpg").write_bytes(image_bytes(make_image(1), "PNG"))
    (gallery / "cars" / "phone.heic").write_bytes(image_bytes(make_image(2), "HEIF"))
    (gallery / "cars" / "no_extension").write_bytes(image_bytes(make_image(3), "HEIF"))
    (gallery / "cars" / "web.webp").write_bytes(image_bytes(make_image(4), "WEBP"))
    (gallery / "cars" / "text.heic").write_text("this is not a picture")
    (gallery / "cars" / "notes.txt").write_text("neither is this")
    (gallery / "cars" / ".tmp_upload").write_bytes(image_bytes(make_image(5), "PNG"))  # a temporary file
    if features.check("avif"):
        (gallery / "cars" / "web.avif").write_bytes(image_bytes(make_image(6), "AVIF"))

    listed = {path.name for path in list_images(gallery)}
    assert listed >= {"really_a_png.jpg", "phone.heic", "no_extension", "web.webp", "text.heic"}
    assert not listed & {"notes.txt", ".tmp_upload"}

    out = tmp_path / "index"
    report = build_index(gallery, Embedder(exported_model, threads=1), out, progress=False)
    assert report.indexed == len(listed) - 1
    assert [path for path, _ in report.skipped] == ["cars/text.heic"]
    assert "not a recognised image format" in report.skipped[0][1]
    index = GalleryIndex.open(out)
    try:
        assert {Path(item.path).name for item in index.items.scan()} == listed - {"text.heic"}
    finally:
        index.close()
