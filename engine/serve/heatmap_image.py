"""Heatmaps drawn over the image the model saw: what the API sends, the UI shows and `dmlsearch explain`
writes."""

from __future__ import annotations

import io

import numpy as np
from matplotlib import colormaps
from PIL import Image, ImageDraw, ImageFont

from engine.serve.explain import Explanation, Heatmap

COLOURMAP = "inferno"
OPACITY = 0.7  # of the colour at the position that carried the most similarity
# `dmlsearch explain`'s PNG: each image at twice the model's 224-pixel view, big enough to see what is
# coloured and outlined, with the explanation in words under them (about 930 x 600 pixels).
DISPLAY_SIDE = 448
MARGIN = 12
FONT_SIZE = 18
PNG_COMPRESS_LEVEL = 1
# The API's overlays are JPEG: several times faster and smaller than PNG, and an explanation sends two per
# request, base64 in JSON (docs/measurements.md).
OVERLAY_JPEG_QUALITY = 90
PEAK_OUTLINE = (0, 255, 255)  # cyan: apart from the colour map's black-red-yellow


def overlay(heatmap: Heatmap, side: int | None = None) -> Image.Image:
    """The model's view with each position tinted by its share of the cosine.

    Positions that raised the similarity are coloured, the most by the largest share; those that lowered
    it (negative shares) stay as they are. The grid is upsampled bilinearly to the view's pixels. The peak
    window (this image's region of the two that matched, ``engine.serve.explain.matched_windows``) is
    outlined. ``side``: the overlay's size in pixels (None: the view's own, the model's input size).
    """
    view = heatmap.view
    if side is not None and side != view.shape[0]:
        view = np.asarray(Image.fromarray(view).resize((side, side), Image.Resampling.LANCZOS))
    raised = np.clip(heatmap.grid, 0.0, None).astype(np.float32)
    peak = float(raised.max())
    scaled = raised / peak if peak > 0 else raised
    size = (view.shape[1], view.shape[0])
    weights = np.asarray(Image.fromarray(scaled, mode="F").resize(size, Image.Resampling.BILINEAR))
    weights = np.clip(weights, 0.0, 1.0)[..., None]
    # The colour map as uint8 (its table, rounded down): 20x faster than its float colours, < 1 level off.
    colours = colormaps[COLOURMAP](weights[..., 0], bytes=True)[..., :3].astype(np.float32)
    blended = view * (1.0 - OPACITY * weights) + colours * (OPACITY * weights)
    image = Image.fromarray(np.clip(np.rint(blended), 0, 255).astype(np.uint8), "RGB")
    x0, y0, x1, y1 = heatmap.peak.box(heatmap.grid.shape, size)
    ImageDraw.Draw(image).rectangle(
        (x0, y0, x1 - 1, y1 - 1), outline=PEAK_OUTLINE, width=max(2, size[0] // 150)
    )
    return image


def png_bytes(image: Image.Image) -> bytes:
    """PNG at zlib level 1 (`dmlsearch explain`'s file): ~3x faster than the default level 6, 10-17%
    larger."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def jpeg_bytes(image: Image.Image) -> bytes:
    """JPEG, as ``/v1/explain`` sends the overlays: photographs tinted smoothly, where JPEG is the fast,
    small encoding."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=OVERLAY_JPEG_QUALITY)
    return buffer.getvalue()


def side_by_side(explanation: Explanation, side: int = DISPLAY_SIDE) -> Image.Image:
    """The query's overlay beside the result's, each ``side`` pixels square under its title, over the
    explanation in words (``Explanation.in_words``), wrapped to the width."""
    font = ImageFont.load_default(size=FONT_SIZE)
    line_height = round(FONT_SIZE * 1.45)
    width = 2 * side + 3 * MARGIN
    lines = [
        line for sentence in explanation.in_words() for line in _wrapped(sentence, font, width - 2 * MARGIN)
    ]
    top = MARGIN + line_height
    height = top + side + MARGIN + line_height * len(lines) + MARGIN
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    for column, (title, heatmap) in enumerate((("query", explanation.query), ("result", explanation.item))):
        x = MARGIN + column * (side + MARGIN)
        draw.text((x, MARGIN), title, fill="black", font=font)
        canvas.paste(overlay(heatmap, side), (x, top))
    for row, line in enumerate(lines):
        draw.text((MARGIN, top + side + MARGIN + row * line_height), line, fill="black", font=font)
    return canvas


def _wrapped(text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` pixels, broken between words."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        longer = f"{line} {word}".strip()
        if line and font.getlength(longer) > width:
            lines.append(line)
            line = word
        else:
            line = longer
    return [*lines, line]
