"""The Streamlit "Duplicates" page: groups of near-duplicate gallery images with thumbnails and scores."""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from app.client import ApiCallError, SearchClient
from app.ui_display import plain
from index.duplicates import DEFAULT_THRESHOLD

GROUPS_PER_PAGE = 10
COLUMNS = 6


def render_duplicates(client: SearchClient, thumbnail: Callable[[int, str], bytes | None]) -> None:
    """``thumbnail(item_id, path)``: the page's cached thumbnail fetcher."""
    st.subheader("Near-duplicates")
    threshold = None  # the index's default
    if st.checkbox("Set the cosine threshold", key="dup_custom"):
        threshold = st.slider(
            "Cosine threshold",
            min_value=0.5,
            max_value=1.0,
            value=DEFAULT_THRESHOLD,
            step=0.01,
            key="dup_threshold",
        )
    page_number = st.number_input("Page", min_value=1, value=1, step=1, key="dup_page")
    try:
        body = client.duplicates(threshold, offset=(page_number - 1) * GROUPS_PER_PAGE, limit=GROUPS_PER_PAGE)
    except ApiCallError as err:
        st.error(f"Duplicates are unavailable: {plain(err)}")
        return
    st.caption(f"{body['total']} groups at {body['criteria']} (largest first)")
    if body["note"]:
        st.warning(plain(body["note"]))
    if not body["groups"]:
        st.info("No near-duplicates on this page.")
        return
    for number, group in enumerate(body["groups"], start=body["offset"] + 1):
        st.markdown(f"**Group {number}** · {group['size']} images")
        items = group["items"]
        for start in range(0, len(items), COLUMNS):
            for column, item in zip(st.columns(COLUMNS), items[start : start + COLUMNS], strict=False):
                with column:
                    image = thumbnail(item["id"], item["path"])
                    if image is not None:
                        st.image(image, width="stretch")
                    st.caption(plain(f"score {item['score']:.3f} · {item['label'] or '-'} · {item['path']}"))
