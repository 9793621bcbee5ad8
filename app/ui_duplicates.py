"""The Streamlit "Duplicates" page: groups of near-duplicate gallery images with thumbnails and scores; by
tier, each image with its evidence and a keep tick (the keeper rule's proposal, with its reason), a button
that applies the page's decisions (``POST /v1/duplicates/apply``: set-aside images go to the gallery's trash
folder) and one that undoes the last apply (``POST /v1/duplicates/undo``)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable

import streamlit as st

from app.client import ApiCallError, SearchClient
from app.ui_display import plain
from engine.duplicates.groups import DEFAULT_THRESHOLD

GROUPS_PER_PAGE = 10
LAST_APPLY, LAST_UNDO = "dup_last_apply", "dup_last_undo"  # session keys: shown after the page's rerun
COLUMNS = 6
ANY_TIER = "all (cosine and signature)"
TIERS = ("exact", "edited", "similar")
TIER_HELP = (
    "exact: same bytes or pixels; edited: re-encoded, resized, cropped, turned, colour-adjusted or "
    "watermarked copies; similar: the same scene (bursts, second takes), which is not a duplicate. Each tier "
    "includes the stricter ones."
)


def render_duplicates(client: SearchClient, thumbnail: Callable[[int, str], bytes | None]) -> None:
    """``thumbnail(item_id, path)``: the page's cached thumbnail fetcher."""
    st.subheader("Near-duplicates")
    tier = st.radio("Tier", [ANY_TIER, *TIERS], horizontal=True, key="dup_tier", help=TIER_HELP)
    if tier != ANY_TIER:
        render_review(client, thumbnail, tier)
        return
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


def render_review(client: SearchClient, thumbnail: Callable[[int, str], bytes | None], tier: str) -> None:
    """The groups of ``tier`` with a keep tick per image, the button that applies the page, and the one
    that undoes the last apply."""
    api_key = st.text_input(
        "API key", value=os.environ.get("DMLSEARCH_API_KEY", ""), type="password", key="dup_api_key"
    )
    render_last_apply(client, api_key)
    page_number = st.number_input("Page", min_value=1, value=1, step=1, key="dup_review_page")
    try:
        body = client.duplicates(offset=(page_number - 1) * GROUPS_PER_PAGE, limit=GROUPS_PER_PAGE, tier=tier)
    except ApiCallError as err:
        st.error(f"Duplicates are unavailable: {plain(err)}")
        return
    st.caption(plain(f"{body['total']} groups up to the {tier} tier: {body['criteria']}"))
    st.caption(
        "Proposed keeper: the source of the copies (the camera's EXIF, then the image the others were cut or "
        "reduced from, then the earliest capture time by the camera's clock, then the image in its label "
        "folder; a file's own time comes last), never the largest file. Untick to set an image aside, tick "
        "to keep it; applying moves set-aside images to the gallery's trash folder (nothing is deleted; Undo "
        "puts them back)."
    )
    if tier == "similar":
        st.info(
            "Similar is not duplicate: these are other takes of a scene, or other things that look alike. "
            "Every image is kept unless you untick it."
        )
    if not body["groups"]:
        st.info("No groups of this tier on this page.")
        return
    plan_groups = []
    for number, group in enumerate(body["groups"], start=body["offset"] + 1):
        st.markdown(f"**Group {number}** · {group['tier']} · {group['size']} images")
        if group.get("reason"):  # absent from servers before the keeper's reason
            kept = [item["path"] for item in group["items"] if item["review"]["action"] == "keep"]
            keeper = f"Keep {kept[0]}: " if len(kept) == 1 else ""
            st.caption(plain(keeper + group["reason"]))
        members = []
        items = group["items"]
        for start in range(0, len(items), COLUMNS):
            for column, item in zip(st.columns(COLUMNS), items[start : start + COLUMNS], strict=False):
                with column:
                    image = thumbnail(item["id"], item["path"])
                    if image is not None:
                        st.image(image, width="stretch")
                    evidence, review = item["evidence"], item["review"]
                    bits = "-" if evidence["signature_bits"] is None else evidence["signature_bits"]
                    digest = f" · {evidence['hash'][:18]}" if evidence["hash"] else ""
                    if evidence.get("alignment") is not None:  # absent from servers before the check
                        digest += f" · aligned NCC {evidence['alignment']:.3f}"
                    copy = " · byte copy (indexed once)" if item.get("byte_copy") else ""
                    st.caption(
                        plain(
                            f"{evidence['tier']} · bits {bits} · cosine {evidence['cosine']:.3f}{digest} · "
                            f"{review['pixels']} px · {review['bytes']} B · {item['path']}{copy}"
                        )
                    )
                    # A byte copy shares its item's id: the path tells the two apart.
                    keep = st.checkbox(
                        "keep",
                        value=review["action"] == "keep",
                        key=f"dup_keep_{tier}_{item['id']}_{item['path']}",
                    )
                    members.append(
                        {
                            "id": item["id"],
                            "path": item["path"],
                            "content_hash": review["content_hash"],
                            "action": "keep" if keep else "set_aside",
                        }
                    )
        if not any(member["action"] == "keep" for member in members):
            st.warning(f"Group {number} keeps no image: tick one to keep, or it cannot be applied.")
        plan_groups.append({"members": members})
    if st.button("Apply: set aside the unticked images", key="dup_apply"):
        plan_id = time.strftime("%Y%m%dT%H%M%SZ-ui-", time.gmtime()) + secrets.token_hex(4)
        plan = {"version": 1, "plan_id": plan_id, "groups": plan_groups}
        try:
            result = client.apply_plan(plan, api_key)
        except ApiCallError as err:
            st.error(f"Not applied: {plain(err)}")
            return
        st.session_state[LAST_APPLY] = result
        st.session_state.pop(LAST_UNDO, None)
        st.rerun()  # the groups again, without the images set aside


def render_last_apply(client: SearchClient, api_key: str) -> None:
    """What the last apply did, with its Undo button; or what the last undo did."""
    undone = st.session_state.get(LAST_UNDO)
    if undone is not None:
        st.success(
            plain(
                f"Put back {len(undone['moved'])} images and their {undone['restored']} items; "
                f"{undone['count']} remain in the index."
            )
        )
        for left in undone["left"]:
            st.warning(plain(f"Left {left['path']}: {left['reason']}"))
    result = st.session_state.get(LAST_APPLY)
    if result is None:
        return
    st.success(
        plain(
            f"Set aside {len(result['moved'])} images into {result['trash']} and removed "
            f"{result['removed']} items from the index; {result['count']} remain. Undo puts them back "
            f"(or: dmlsearch duplicates --index INDEX --undo {result['plan_id']})."
        )
    )
    for left in result["left"]:
        st.warning(plain(f"Left {left['path']}: {left['reason']}"))
    if st.button("Undo", key="dup_undo"):
        try:
            undone = client.undo_plan(result["plan_id"], api_key)
        except ApiCallError as err:
            st.error(f"Not undone: {plain(err)}")
            return
        st.session_state[LAST_UNDO] = undone
        st.session_state.pop(LAST_APPLY, None)
        st.rerun()  # the groups again, with the images put back
