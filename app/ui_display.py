"""What the Streamlit pages show of data they do not control: text as plain text, images decoded safely.

Streamlit renders Markdown (links, images, which the browser then fetches) in captions, messages and
markdown; a gallery folder named ``![x](https://host/?beacon)`` (``build-index`` and ``watch`` keep folder
names as they are) must show as those characters. Images are shown from a JPEG this page makes itself:
decoded under the API's pixel limit (before any pixel is decoded), EXIF orientation applied, any mode
the API accepts (LAB, 32-bit float, 16-bit grey) converted to RGB, so ``st.image`` never meets a mode it
cannot write or a decompression bomb.
"""

from __future__ import annotations

import re

from engine.decode.images import ImageDecodeError, thumbnail_jpeg
from foundation import defaults

# CommonMark lets a backslash escape any ASCII punctuation: escaping all of it leaves no Markdown or HTML.
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")
PREVIEW_SIZE = 480


def plain(text: object) -> str:
    """``text`` escaped so that Streamlit's Markdown shows it as typed."""
    return _PUNCTUATION.sub(r"\\\1", str(text))


def preview(data: bytes, max_pixels: int = defaults.MAX_IMAGE_PIXELS) -> bytes | None:
    """A JPEG of an uploaded image for display, or None when it cannot be shown within the limits."""
    try:
        return thumbnail_jpeg(data, PREVIEW_SIZE, max_pixels=max_pixels)
    except (ImageDecodeError, OSError, ValueError):
        return None
