"""Heatmaps drawn over the image the model saw: what the API sends, the UI shows and `dmlsearch explain`
writes."""

from __future__ import annotations

import io

import numpy as np
from matplotlib import colormaps
from PIL import Image, ImageDraw

from engine.serve.explain import Explanation, Heatmap

COLOURMAP = "inferno"
OPACITY = 0.7  # of the colour at the position that carried the most similarity
CAPTION_HEIGHT = 24
PNG_COMPRESS_LEVEL = 1
# The API's overlays: JPEG encodes a 224-px overlay in ~1 ms and ~19 KB, PNG at level 1 in 5-11 ms and
# ~90 KB (an explanation draws two per request, sent base64 in JSON).
OVERLAY_JPEG_QUALITY = 90
PEAK_OUTLINE = (0, 255, 255)  # cyan: apart from the colour map's black-red-yellow


def overlay(heatmap: Heatmap) -> Image.Image:
    """The model's view with each position tinted by its share of the cosine.

    Positions that raised the similarity are coloured, the most by the largest share; those that lowered
    it (negative shares) stay as they are. The grid is upsampled bilinearly to the view's pixels. The peak
    window (this image's region of the two that matched, ``engine.serve.explain.matched_windows``) is
    outlined.
    """
    view = heatmap.view
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
    x0, y0, x1, y1 = heatmap.peak_box
    ImageDraw.Draw(image).rectangle((x0, y0, x1 - 1, y1 - 1), outline=PEAK_OUTLINE, width=2)
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


def side_by_side(explanation: Explanation) -> Image.Image:
    """The query's overlay beside the item's, with the cosine and each image's share of it as a caption."""
    query, item = overlay(explanation.query), overlay(explanation.item)
    width, height = query.width + item.width, max(query.height, item.height)
    canvas = Image.new("RGB", (width, height + CAPTION_HEIGHT), "white")
    canvas.paste(query, (0, CAPTION_HEIGHT))
    canvas.paste(item, (query.width, CAPTION_HEIGHT))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 6), f"query  (rest {explanation.query.rest:+.3f})", fill="black")
    draw.text((query.width + 4, 6), f"item  cosine {explanation.cosine:.3f}", fill="black")
    return canvas
