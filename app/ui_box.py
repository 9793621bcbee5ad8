"""Search by a region on the Streamlit page: a box drawn on the query image (streamlit-cropper).

The box is drawn on the page's own upright preview of the query (``app.ui_display.preview``) and sent to
the API as fractions of its width and height, which the API applies to the full-size upright image: the
preview's smaller size does not move the box.
"""

from __future__ import annotations

import streamlit as st
from streamlit_cropper import st_cropper

from engine.decode.images import open_image

BOX_COLOUR = "#ff4b4b"


def region_box(shown: bytes, key: str) -> str | None:
    """Offer to draw a box on ``shown`` (a preview JPEG); the API's ``box`` parameter, or None (the whole
    image)."""
    if not st.checkbox("Search by a region (draw a box on the query)", key=f"{key}-on"):
        return None
    image = open_image(shown)  # the page's own preview, through the same checked opener as any image
    rect = st_cropper(image, realtime_update=True, box_color=BOX_COLOUR, return_type="box", key=key)
    edges = (
        rect["left"] / image.width,
        rect["top"] / image.height,
        (rect["left"] + rect["width"]) / image.width,
        (rect["top"] + rect["height"]) / image.height,
    )
    return ",".join(f"{min(max(edge, 0.0), 1.0):.4f}" for edge in edges)
