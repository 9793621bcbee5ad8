"""What the Streamlit pages show of data they do not control: text as plain text, images decoded safely.

Streamlit renders Markdown (links, images, which the browser then fetches) in captions, messages and
markdown; a gallery folder named ``![x](https://host/?beacon)`` (``build-index`` and ``watch`` keep folder
names as they are) must show as those characters. An upload is shown from a JPEG made of it in a decode
process (``engine.decode.pool``) under the API's limits, never in the page's own process (a 34-byte WebP
declaring 49 MP took this process to 971 MB, a 10,000-scan JPEG 165 s of its CPU): EXIF orientation
applied, any mode the API accepts (LAB, 32-bit float, 16-bit grey) converted to RGB, so ``st.image`` only
meets a JPEG of at most ``PREVIEW_SIZE`` pixels. Gallery images come from the API's thumbnails.
"""

from __future__ import annotations

import re
from functools import cache

from engine.decode.images import thumbnail_jpeg
from engine.decode.pool import DecodePool
from foundation import defaults

# CommonMark lets a backslash escape any ASCII punctuation: escaping all of it leaves no Markdown or HTML.
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")
PREVIEW_SIZE = 480


def plain(text: object) -> str:
    """``text`` escaped so that Streamlit's Markdown shows it as typed."""
    return _PUNCTUATION.sub(r"\\\1", str(text))


@cache  # one pool for every session of this page's process
def preview_decoder() -> DecodePool:
    """The page's decode processes, under the API's default limits (each decode ends within them, whether
    or not anyone still looks at the page)."""
    return DecodePool(defaults.DECODE_WORKERS)


def preview(data: bytes) -> bytes:
    """A JPEG of an uploaded image for display, made in a decode process. Raises ``ImageDecodeError`` (a
    ``ValueError``: its message says what is wrong), ``OSError``, or ``MemoryError`` (a decode process
    killed)."""
    return preview_decoder().run(thumbnail_jpeg, data, PREVIEW_SIZE, max_pixels=defaults.MAX_IMAGE_PIXELS)
