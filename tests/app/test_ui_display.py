"""What the Streamlit pages show of data they do not control (app/ui_display.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from markdown_it import MarkdownIt
from PIL import Image

from app.ui_display import plain, preview
from bench.lib.images import image_bytes, make_image
from engine.decode.images import ImageDecodeError

HOSTILE_TEXTS = [
    "![x](https://host/?beacon)",
    "[click](javascript:alert(1))",
    "<img src=https://host/beacon>",
    "**bold** _it_ `code` # heading",
    "<https://host/auto>",
]


@pytest.mark.parametrize("text", HOSTILE_TEXTS)
def test_plain_text_renders_as_typed_with_no_link_image_or_html(text: str) -> None:
    html = MarkdownIt("commonmark").render(plain(text))
    assert "<img" not in html and "<a " not in html and "<strong" not in html and "<code" not in html
    assert html.startswith("<p>") and "&lt;" in html if "<" in text else True


def _decoded(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def test_preview_applies_the_exif_orientation() -> None:
    """Before: the query preview showed st.image(data), a 'rotate 90' photo sideways (issue 27.5)."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to show it
    data = image_bytes(make_image(1, (120, 60)), "JPEG", exif=exif.tobytes())
    assert _decoded(preview(data)).size == (60, 120)


@pytest.mark.parametrize(
    ("mode", "fmt"), [("LAB", "TIFF"), ("F", "TIFF"), ("I;16", "PNG"), ("CMYK", "JPEG"), ("RGBA", "PNG")]
)
def test_preview_shows_every_mode_the_api_accepts(mode: str, fmt: str) -> None:
    """Before: LAB, float and 16-bit grey uploads crashed the page ("cannot write mode LAB as JPEG")."""
    if mode == "F":
        image = Image.fromarray(np.linspace(0, 1, 64 * 48, dtype=np.float32).reshape(48, 64), "F")
    elif mode == "I;16":
        image = Image.fromarray(np.arange(64 * 48, dtype=np.uint16).reshape(48, 64) * 20)
    else:
        image = make_image(2, (64, 48)).convert(mode)
    shown = _decoded(preview(image_bytes(image, fmt)))
    assert shown.format == "JPEG" and shown.size == (64, 48)


def test_preview_refuses_an_image_over_the_pixel_limit_before_decoding_it() -> None:
    """Before: a 34-byte WebP took the page to 924 MB; the preview keeps the API's pixel limit."""
    data = image_bytes(Image.new("L", (8000, 7000)), "PNG")  # 56 MP
    with pytest.raises(ImageDecodeError) as refused:
        preview(data)
    assert refused.value.code == "image_too_large"
