"""Streamlit page: upload an image, see the most similar gallery images with their scores.

A pure client of the HTTP API (``DMLSEARCH_API_URL``), so it works against a remote server too.
Run with ``dmlsearch ui`` or ``streamlit run app/ui.py``.
"""

from __future__ import annotations

import os

import httpx
import streamlit as st

API_URL = os.environ.get("DMLSEARCH_API_URL", "http://127.0.0.1:8000").rstrip("/")
COLUMNS = 4


def api_error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


@st.cache_data(ttl=30, show_spinner=False)
def fetch_stats(api_url: str) -> dict | None:
    try:
        response = httpx.get(f"{api_url}/v1/stats", timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


@st.cache_data(max_entries=512, show_spinner=False)
def fetch_item_image(api_url: str, item_id: int) -> bytes | None:
    response = httpx.get(f"{api_url}/v1/items/{item_id}/image", timeout=10)
    return response.content if response.status_code == 200 else None


def render_results(results: list[dict]) -> None:
    if not results:
        st.info("No gallery image scored above the minimum score.")
        return
    for start in range(0, len(results), COLUMNS):
        for column, result in zip(st.columns(COLUMNS), results[start : start + COLUMNS], strict=False):
            with column:
                image = fetch_item_image(API_URL, result["id"])
                if image is not None:
                    st.image(image, use_container_width=True)
                st.markdown(f"**#{result['rank']} · score {result['score']:.3f}**")
                st.caption(f"{result['label'] or '-'} · {result['path']}")


def main() -> None:
    st.set_page_config(page_title="dmlsearch", layout="wide")
    st.title("dmlsearch: image search")
    stats = fetch_stats(API_URL)
    with st.sidebar:
        st.header("Index")
        if stats is None:
            st.error(f"The API at {API_URL} is not reachable or not ready.")
        else:
            st.metric("Images", stats["count"])
            st.write(f"{stats['dim']}-d · {stats['backend']} {stats['index_type']} · {stats['metric']}")
            st.caption(f"model {stats['model_fingerprint'][:12]}")
        k = st.slider("Results (K)", min_value=1, max_value=48, value=12)
        min_score = st.slider("Minimum score", min_value=-1.0, max_value=1.0, value=0.0, step=0.05)

    upload = st.file_uploader("Query image", type=["jpg", "jpeg", "png", "webp", "bmp", "gif"])
    if upload is None:
        st.write("Upload an image to find visually similar gallery images.")
        return
    st.image(upload.getvalue(), caption="query", width=240)
    try:
        response = httpx.post(
            f"{API_URL}/v1/search",
            params={"k": k, "min_score": min_score},
            files={"image": (upload.name, upload.getvalue(), upload.type or "application/octet-stream")},
            timeout=60,
        )
    except httpx.HTTPError as err:
        st.error(f"Could not reach the API: {err}")
        return
    if response.status_code != 200:
        st.error(f"Search failed: {api_error_message(response)}")
        return
    body = response.json()
    st.caption(f"{len(body['results'])} results in {body['took_ms']:.0f} ms")
    render_results(body["results"])


main()
