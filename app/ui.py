"""Streamlit page: query by an uploaded image or a gallery item, see the most similar images with scores,
judge them (👍, 👎) and refine the search by those judgments.

A pure client of the HTTP API (``DMLSEARCH_API_URL``), so it works against a remote server too.
Run with ``dmlsearch ui`` or ``streamlit run app/ui.py``.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from functools import partial

import streamlit as st

from app.client import ApiCallError, SearchClient
from app.ui_box import region_box
from app.ui_display import plain, preview
from app.ui_duplicates import render_duplicates
from app.ui_model import render_model
from engine.decode.images import IMAGE_SUFFIXES
from engine.serve.refine import Strategy
from foundation import defaults

API_URL = os.environ.get("DMLSEARCH_API_URL", defaults.API_URL).rstrip("/")
COLUMNS = 4
# The sidebar's date filter: by when photos were taken (what a photo library is browsed by) or indexed.
DATE_FILTERS = {"Taken": "taken", "Indexed": "added"}
UPLOAD, GALLERY = "Upload an image", "Pick a gallery item"
SEARCH_PAGE, DUPLICATES_PAGE, MODEL_PAGE = "Search", "Duplicates", "Model"
# The Search page's controls by session-state key, with their defaults (no filter: None or empty).
SEARCH_DEFAULTS = {
    # Not the API's defaults (foundation.defaults TOP_K, MIN_SCORE) on purpose: 12 fills three rows of the
    # grid, and a person looking at photos has no use for results pointing away from the query (cosine < 0).
    "k": 3 * COLUMNS,
    "min_score": 0.0,
    "predict": True,
    "filter_labels": [],
    "filter_prefix": "",
    "filter_clock": next(iter(DATE_FILTERS)),
    "filter_from": None,
    "filter_to": None,
    "strategy": defaults.REFINE_STRATEGY,
    # With the server's API key, every 👍 and 👎 is also kept in the index (POST /v1/feedback).
    "feedback_api_key": os.environ.get("DMLSEARCH_API_KEY", ""),
}
LIKE, UNLIKE = 1, -1
SIGNS = {LIKE: "👍", UNLIKE: "👎"}


@st.cache_resource
def api_client(api_url: str) -> SearchClient:
    return SearchClient(api_url)


@st.cache_data(ttl=30, show_spinner=False)
def fetch_stats(api_url: str) -> dict | str:
    """The index stats, or the reason they are unavailable."""
    try:
        return api_client(api_url).stats()
    except ApiCallError as err:
        return str(err)


@st.cache_data(ttl=30, show_spinner=False)
def fetch_items(api_url: str) -> dict[int, dict]:
    try:
        return {item["id"]: item for item in api_client(api_url).items()["items"]}
    except ApiCallError:
        return {}


@st.cache_data(ttl=30, show_spinner=False)
def fetch_labels(api_url: str) -> list[str]:
    try:
        return api_client(api_url).labels()
    except ApiCallError:
        return []


@st.cache_data(max_entries=1024, show_spinner=False)
def fetch_thumbnail(api_url: str, item_id: int, path: str) -> bytes | None:
    """``path`` is part of the cache key: an id reused after a delete must not show the old picture."""
    try:
        return api_client(api_url).thumbnail(item_id, defaults.THUMBNAIL_SIZE)
    except ApiCallError:
        return None


def search_by_item(item_id: int) -> None:
    """Clicking "Similar" under a result makes that result the query."""
    st.session_state.source = GALLERY
    st.session_state.item_id = item_id


def judge(item_id: int, sign: int, path: str, query: dict) -> None:
    """A 👍 or 👎 under a result; the same one clicked again takes it back. Judgments wait for "Refine".
    With an API key each is also kept by the server (``query``: the API's way of naming the query), and a
    judgment taken back or changed is deleted there."""
    judgments, kept = st.session_state.judgments, st.session_state.kept
    previous = judgments.pop(item_id, (0, ""))[0]
    if previous != sign:
        judgments[item_id] = (sign, path)
    api_key = st.session_state.feedback_api_key
    if not api_key:
        return
    client = api_client(API_URL)
    try:
        if item_id in kept:
            client.delete_feedback(kept.pop(item_id), api_key)
        if previous != sign:
            kept[item_id] = client.add_feedback(query, item_id, sign, api_key)["id"]
    except ApiCallError as err:
        st.session_state.feedback_error = str(err)


def refine() -> None:
    """Search again with the judgments made so far (the judged items then leave the results)."""
    st.session_state.refined = dict(st.session_state.judgments)


def clear_judgments() -> None:
    """Forget this page's judgments (those the server keeps stay there: `dmlsearch feedback`)."""
    st.session_state.judgments, st.session_state.refined, st.session_state.kept = {}, {}, {}


def keep_judgments(query: str) -> None:
    """Judgments are of one query's results: they stay on the page while it is the query, and another query
    starts with none."""
    if st.session_state.get("judged_query") != query or "judgments" not in st.session_state:
        st.session_state.judged_query = query
        clear_judgments()


def refinement_params() -> dict:
    """The API's parameters of the refinement asked for with "Refine" (none before)."""
    refined: dict[int, tuple[int, str]] = st.session_state.refined
    if not refined:
        return {}
    return {
        "positive": [item_id for item_id, (sign, _) in refined.items() if sign == LIKE],
        "negative": [item_id for item_id, (sign, _) in refined.items() if sign == UNLIKE],
        "strategy": st.session_state.strategy,
    }


def render_judgments() -> None:
    """The judgments of this query, what a refined search used, and the actions on them."""
    judgments: dict[int, tuple[int, str]] = st.session_state.judgments
    error = st.session_state.pop("feedback_error", None)
    if error:
        st.warning(f"A judgment could not be kept by the server: {plain(error)}")
    if not judgments:
        st.caption("Judge results with 👍 and 👎, then refine the search by them.")
        return
    counts = " · ".join(
        f"{mark} {sum(sign == value for sign, _ in judgments.values())}" for value, mark in SIGNS.items()
    )
    st.markdown(f"**Your judgments:** {counts}")
    for start in range(0, len(judgments), 2 * COLUMNS):
        row = list(judgments.items())[start : start + 2 * COLUMNS]
        for column, (item_id, (sign, path)) in zip(st.columns(2 * COLUMNS), row, strict=False):
            with column:
                thumbnail = fetch_thumbnail(API_URL, item_id, path)
                if thumbnail is not None:
                    st.image(thumbnail, caption=f"{SIGNS[sign]} item {item_id}", width="stretch")
    pending = judgments != st.session_state.refined
    st.button("Refine", key="refine", on_click=refine, type="primary", disabled=not pending)
    st.button("Clear judgments", key="clear-judgments", on_click=clear_judgments)
    if st.session_state.refined:
        used = len(st.session_state.refined)
        st.caption(
            f"Results refined by {used} judgment(s) ({st.session_state.strategy}); judged items are left out."
        )


def render_index_stats(stats: dict | str) -> None:
    with st.sidebar:
        st.header("Index")
        if isinstance(stats, str):
            st.error(f"The API at {plain(API_URL)} is not ready: {plain(stats)}")
            return
        st.metric("Images", stats["count"])
        st.write(plain(f"{stats['dim']}-d · {stats['backend']} {stats['index_type']} · {stats['metric']}"))
        if stats["achieved_recall"] is not None:
            st.write(f"index recall {stats['achieved_recall']:.3f}")
        st.caption(plain(f"model {stats['model']['backbone']} · {stats['model_fingerprint'][:12]}"))


def keep_search_settings() -> None:
    """The search controls are drawn on the Search page only (they do not apply to the others), and
    Streamlit forgets the value of a widget a run does not draw: the values live in the session state
    instead, which also gives each control its default (so no widget is given a ``value`` as well)."""
    for key, default in SEARCH_DEFAULTS.items():
        st.session_state[key] = st.session_state.get(key, default)


def render_search_controls() -> tuple[dict, dict]:
    """The search parameters, and the filters set (the API's parameter names)."""
    with st.sidebar:
        st.header("Search")
        params = {
            "k": st.slider("Results (K)", min_value=1, max_value=48, key="k"),
            "min_score": st.slider(
                "Minimum score", min_value=-1.0, max_value=1.0, step=0.05, key="min_score"
            ),
            "predict": st.checkbox("Predict the label", key="predict"),
        }
        st.text_input(
            "API key (keeps 👍 and 👎)",
            type="password",
            key="feedback_api_key",
            help="With the server's API key, every judgment is also kept in the index, for training on them "
            "(dmlsearch feedback lists them); without it they only refine this page's search.",
        )
        st.selectbox(
            "Refine by",
            [strategy.value for strategy in Strategy],
            key="strategy",
            help="How 👍 and 👎 refine the search (Qdrant's strategies): average_vector searches by "
            "2 avg(liked and the query) - avg(disliked); best_score ranks by the best cosine to a liked "
            "image or the query, or minus the square of the best cosine to a disliked one where higher.",
        )
        return params, render_filters()


def render_filters() -> dict:
    """Search only within labels, a sub-folder and a range of dates, by when the photos were taken or when
    they were indexed (only the filters set are sent)."""
    st.header("Filter")
    labels = st.multiselect("Labels", fetch_labels(API_URL), accept_new_options=True, key="filter_labels")
    prefix = st.text_input("Sub-folder (path prefix)", key="filter_prefix").strip()
    clock = st.radio(
        "Dates",
        list(DATE_FILTERS),
        horizontal=True,
        key="filter_clock",
        help="Taken: the EXIF capture time (else the file's time), on the camera's clock. "
        "Indexed: when the photo was added to the index (UTC).",
    )
    date_from = st.date_input(f"{clock} from", key="filter_from")
    date_to = st.date_input(f"{clock} before", key="filter_to")
    field = DATE_FILTERS[clock]
    chosen = {
        "label": labels,
        "path_prefix": prefix,
        f"{field}_from": date_from.isoformat() if date_from else None,
        f"{field}_to": date_to.isoformat() if date_to else None,
    }
    return {name: value for name, value in chosen.items() if value}


def render_explanation(explain: Callable[[int], dict], item_id: int) -> None:
    """Both heatmaps of why ``item_id`` matched the query (``/v1/explain``), in the result's column."""
    try:
        body = explain(item_id)
    except ApiCallError as err:
        st.warning(f"No explanation: {plain(err)}")
        return
    for side, name in (("query", "query"), ("item", "result")):
        st.image(base64.b64decode(body[side]["overlay_jpeg"]), caption=f"why: {name}", width="stretch")
    st.caption(plain(body["summary"]))  # the API's words: the similarity, the colours, the outlined regions


def render_results(body: dict, *, filtered: bool, explain: Callable[[int], dict], query: dict) -> None:
    """``filtered``: whether a label, sub-folder or date filter restricted the search; ``explain``: the
    explanation of a result by its id (shown under the result when its toggle is on); ``query``: the query
    as a judgment names it (``POST /v1/feedback``)."""
    results = body["results"]
    timings = " · ".join(f"{stage} {ms:.0f}" for stage, ms in body["timings_ms"].items())
    st.caption(f"{len(results)} results in {body['took_ms']:.0f} ms ({timings} ms)")
    if body.get("prediction"):
        prediction = body["prediction"]
        # Under a label filter only the allowed labels vote: say so, or a 100% vote looks like certainty.
        among = ", among the results within the filters" if filtered else ""
        st.success(
            f"Predicted label: **{plain(prediction['label'])}** "
            f"({prediction['confidence']:.0%} of the vote{among})"
        )
    if not results:
        within = " within the filters" if filtered else ""
        st.info(f"No gallery image{within} scored at least the minimum score.")
        return
    for start in range(0, len(results), COLUMNS):
        for column, result in zip(st.columns(COLUMNS), results[start : start + COLUMNS], strict=False):
            with column:
                thumbnail = fetch_thumbnail(API_URL, result["id"], result["path"])
                if thumbnail is not None:
                    st.image(thumbnail, width="stretch")
                st.markdown(f"**#{result['rank']} · score {result['score']:.3f}**")
                st.caption(plain(f"{result['label'] or '-'} · {result['path']}"))
                st.button(
                    "Similar", key=f"similar-{result['id']}", on_click=search_by_item, args=(result["id"],)
                )
                render_judge_buttons(result, query)
                if st.toggle("Why it matched", key=f"why-{result['id']}"):
                    render_explanation(explain, result["id"])


def render_judge_buttons(result: dict, query: dict) -> None:
    sign = st.session_state.judgments.get(result["id"], (0, ""))[0]
    for value, mark in SIGNS.items():
        st.button(
            mark,
            key=f"judge-{value}-{result['id']}",
            on_click=judge,
            args=(result["id"], value, result["path"], query),
            type="primary" if sign == value else "secondary",
            help="Take it back" if sign == value else "More like this" if value == LIKE else "Less like this",
        )


def run_query(params: dict) -> tuple[dict, Callable[[int], dict], dict] | None:
    """Show the query picker and the query image; return the API's answer, how to explain one of its
    results and the query as a judgment names it (None: nothing to show)."""
    client = api_client(API_URL)
    source = st.radio("Query", [UPLOAD, GALLERY], horizontal=True, key="source")
    if source == UPLOAD:
        upload = st.file_uploader("Query image", type=sorted(suffix[1:] for suffix in IMAGE_SUFFIXES))
        if upload is None:
            st.write("Upload an image to find visually similar gallery images.")
            return None
        data = upload.getvalue()
        keep_judgments(f"upload {hashlib.sha256(data).hexdigest()}")
        try:
            shown = preview(data)
        except (ValueError, OSError, MemoryError) as err:  # what the API would answer too: not sent
            st.error(f"This image cannot be shown or searched: {plain(err)}")
            return None
        box = region_box(shown, key="upload-box")
        box_param = {"box": box} if box else {}  # the explanation is of the region searched by
        try:
            body = client.search(upload.name, data, **params, **box_param, **refinement_params())
        except ApiCallError as err:
            st.error(f"This image could not be searched: {plain(err)}")
            return None
        if box is None:
            st.image(shown, caption="query", width=240)
        query = {"query_image": base64.b64encode(data).decode("ascii")}  # the whole image, boxed or not
        return body, partial(client.explain, upload=(upload.name, data), box=box), query
    items = fetch_items(API_URL)
    options = sorted(items)
    if st.session_state.get("item_id") not in items and st.session_state.get("item_id") is not None:
        options.append(st.session_state.item_id)  # a result beyond the listed page
    if not options:
        st.info("The gallery is empty or unavailable.")
        return None
    item_id = st.selectbox(
        "Gallery item",
        options,
        key="item_id",
        format_func=lambda i: (
            f"{items[i]['label'] or '-'} · {items[i]['path']}" if i in items else f"item {i}"
        ),
    )
    keep_judgments(f"item {item_id}")
    thumbnail = fetch_thumbnail(API_URL, item_id, items.get(item_id, {}).get("path", ""))
    box = None if thumbnail is None else region_box(thumbnail, key=f"item-box-{item_id}")
    if thumbnail is not None and box is None:
        st.image(thumbnail, caption=f"query: item {item_id}", width=240)
    box_param = {"box": box} if box else {}  # the explanation is of the region searched by
    try:
        body = client.similar(item_id, **params, **box_param, **refinement_params())
    except ApiCallError as err:
        st.error(f"Search by item {item_id} failed: {plain(err)}")
        return None
    return body, partial(client.explain, query_item=item_id, box=box), {"query_item": item_id}


def main() -> None:
    st.set_page_config(page_title="dmlsearch", layout="wide")
    st.title("dmlsearch: image search")
    keep_search_settings()
    stats = fetch_stats(API_URL)
    view = st.sidebar.radio("Page", [SEARCH_PAGE, DUPLICATES_PAGE, MODEL_PAGE], key="page")
    render_index_stats(stats)
    if isinstance(stats, str):
        return
    if view == MODEL_PAGE:
        render_model(api_client(API_URL))
        return
    if view == DUPLICATES_PAGE:
        render_duplicates(api_client(API_URL), lambda item_id, path: fetch_thumbnail(API_URL, item_id, path))
        return
    params, filters = render_search_controls()
    answer = run_query(params | filters)
    if answer is not None:
        body, explain, query = answer
        render_judgments()
        render_results(body, filtered=bool(filters), explain=explain, query=query)


main()
