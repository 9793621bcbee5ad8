"""Decoding untrusted image bytes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from bench.lib.hostile_images import gif_frame_offset, gif_many_comment_blocks, png_comment_text
from bench.lib.images import image_bytes, make_image
from engine.decode.images import ImageDecodeError, decode_image, image_header, thumbnail_jpeg


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "CMYK", "LA", "I;16"])
def test_every_mode_becomes_rgb(mode: str) -> None:
    fmt = "JPEG" if mode == "CMYK" else "TIFF" if mode == "I;16" else "PNG"
    image = make_image(1, mode="RGB")
    source = image.convert(mode) if mode != "I;16" else image.convert("L").convert("I;16")
    decoded = decode_image(image_bytes(source, fmt))
    assert decoded.mode == "RGB"
    assert decoded.size == image.size


def test_exif_orientation_is_applied() -> None:
    image = make_image(2, size=(120, 60))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    decoded = decode_image(image_bytes(image, "JPEG", exif=exif))
    assert decoded.size == (60, 120)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "empty_image"),
        (b"hello, I am a text file", "not_an_image"),
        (b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF", "not_an_image"),
    ],
)
def test_non_images_are_refused(data: bytes, code: str) -> None:
    with pytest.raises(ImageDecodeError) as info:
        decode_image(data)
    assert info.value.code == code


def test_truncated_jpeg_is_refused() -> None:
    data = image_bytes(make_image(3, size=(256, 256)), "JPEG")
    with pytest.raises(ImageDecodeError) as info:
        decode_image(data[: len(data) // 2])
    assert info.value.code == "corrupt_image"


def test_pixel_limit_refuses_decompression_bombs() -> None:
    data = image_bytes(Image.new("L", (4000, 4000)), "PNG")
    with pytest.raises(ImageDecodeError) as info:
        decode_image(data, max_pixels=1_000_000)
    assert info.value.code == "image_too_large"


def test_draft_decoding_keeps_enough_resolution() -> None:
    data = image_bytes(make_image(4, size=(1600, 1200)), "JPEG")
    decoded = decode_image(data, draft_size=224)
    assert min(decoded.size) >= 224
    assert decoded.size[0] < 1600


@pytest.mark.parametrize(
    "data",
    [gif_many_comment_blocks(100_000), png_comment_text(100)],
    ids=["gif-comment-100kb", "png-comment-text-100kb"],
)
def test_a_thumbnail_carries_none_of_the_source_metadata(data: bytes) -> None:
    """Pillow wrote the source's ``info["comment"]`` into the JPEG: over 64 KB, the save raised ValueError
    (a 500 from /v1/items/{id}/thumbnail, no preview in the UI)."""
    thumbnail = Image.open(io.BytesIO(thumbnail_jpeg(data, 64)))
    assert thumbnail.format == "JPEG"
    assert "comment" not in thumbnail.info


def test_a_header_over_the_decoders_own_limit_is_refused_naming_ours() -> None:
    """A 43-byte GIF whose 1x1 frame sits at (65000, 65000) declares 4.2 GP: Pillow refuses it at open,
    and its message named Pillow's limit (178956970 pixels), not the server's."""
    with pytest.raises(ImageDecodeError) as refused:
        decode_image(gif_frame_offset(65000), max_pixels=1000)
    assert refused.value.code == "image_too_large"
    assert "more than the limit of 1000" in refused.value.message


def test_image_header_reads_a_supported_file_and_nothing_else(tmp_path: Path) -> None:
    """The one opener of a file's header (is_image_file, photo_time, the duplicate review's file facts)."""
    photo = tmp_path / "photo.png"
    make_image(3, size=(40, 30)).save(photo)
    with image_header(photo) as image:
        assert image is not None and (image.format, image.size) == ("PNG", (40, 30))
    unsupported = tmp_path / "photo.ppm"  # Pillow opens it; the gallery does not take it
    make_image(3, size=(40, 30)).save(unsupported)
    (tmp_path / "notes.txt").write_text("not an image")
    for path in (unsupported, tmp_path / "notes.txt", tmp_path / "missing.png"):
        with image_header(path) as image:
            assert image is None
