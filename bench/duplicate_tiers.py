"""Duplicate tiers: precision and recall per tier on real photos with generated copies, and the time for all
groups of 100k items.

    python bench/duplicate_tiers.py --data CARS196 --model MODEL.onnx

1. Quality. Photos: Cars196 test photos of ``--classes`` car models (``--per-class`` photos each) and the
   demo gallery's source photos (engine.gallery.demo); each photo is the central 85% window of its source
   image, so that a second take can hold what lies outside it. The Cars196 models are split in two
   halves, A and B; ``--sources`` photos of each half get copies, made from the photo:
   - exact: the same pixels saved again as PNG with a text chunk (other bytes);
   - edited, one copy per kind: re-encoded (JPEG q=50), resized to half, centre-cropped to 90%, cropped
     off-centre (to 88%; 6% off two sides; to 82%x82% the other way; to 85% and re-encoded), rotated 3
     degrees (cropped to the rotated frame), rotated -2 degrees and cropped off-centre, rotated 90 degrees,
     mirrored,
     colour-adjusted (saturation 1.3, brightness 1.1, contrast 0.9), watermarked (a translucent
     text banner and a logo box);
   - similar (a second take, simulated: the camera moved, so neither image is a window of the other):
     another 85% window of the source image, 7.5% further right and 5% further down than the photo (so
     it holds a strip the photo lacks and lacks one the photo holds), seen from a turned camera (a
     homography: the window's left edge 3% of the source's height shorter at the top and at the
     bottom), 5% brighter. The demo's stereo motorcycle (a left and a right view of one scene) is a real
     second take.
   Different photos of the same car model are the near-but-different pairs: never a tier.
   Every image is embedded and signed as build-index does (the photo's source decoded with the JPEG draft). A
   pair's true tier: exact for the photo and its PNG copy, similar where a take is involved, edited for
   any other two images made from one photo; pairs of different photos have none.
   The tier thresholds are chosen on half A (the edited tier: the highest recall with precision >= 0.98,
   and images in a false edited group <= 1%, the strictest among equals; then the similar tier, at that
   edited setting: the highest min(precision, recall); then the aligned check's cosine and NCC, the same
   way as the edited tier, and the fewest pairs it checks between two signature groups whose copies are
   grouped with their photo within 1 point of checking every pair), and everything is reported on half
   B (plus the demo photos and their copies), by ``find_tiered`` itself at the settings chosen on A;
   both halves are also reported at the library's defaults.
2. Speed. ``find_tiered`` for the edited and the similar tier over bench/duplicates.py's synthetic index
   of 100k vectors made from this bench's real embeddings (random signatures and thumbnails, planted
   copies, and for the aligned check planted off-centre crops and other photos of the same thing), at
   the settings chosen on A and at the library's defaults. ``--speed-only`` reruns this part alone.

Signatures are computed again, without embedding again, when engine/duplicates/signature.py changed.

Writes ``bench/results/duplicate_tiers.{json,md}``. Embeddings are cached in ``--cache``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from lib.duplicate_sets import (
    EDITS,
    FALSE_IMAGE_GOAL,
    KINDS,
    PHOTO_WINDOW,
    PRECISION_GOAL,
    TAKE_TURN,
    TAKE_WINDOW,
    all_true_pairs,
    bench_images,
    build_items,
    digests_for,
    false_edited_images,
    half_index,
    make_copy,
    pair_scores,
    photo_window,
    record_of,
    resign,
    second_take,
    synthetic_index,
    true_tiers,
)
from lib.options import bench_parser, data_option, model_option, out_option, seed_option

from engine.duplicates import signature as signature_module
from engine.duplicates.groups import group_pairs
from engine.duplicates.tiers import (
    ALIGNED_COSINE,
    ALIGNED_NCC,
    ALIGNED_TRIES,
    EDITED_BITS,
    EDITED_COSINE,
    SIMILAR_BITS,
    SIMILAR_COSINE,
    TURNED_COSINE,
    Tier,
    TierSettings,
    classify,
    find_tiered,
    tier_pairs,
)
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex

# The upright views' cosine; pairs matching through a turned view keep the library's TURNED_COSINE.
EDITED_COSINES = np.round(np.arange(0.30, 0.951, 0.05), 2)
EDITED_BITS_TRIED = (4, 6, 8, 10)
SIMILAR_COSINES = np.round(np.arange(0.70, 0.981, 0.02), 2)
ALIGNED_COSINES = np.round(np.arange(0.80, 0.901, 0.025), 3)
ALIGNED_NCCS = np.round(np.arange(0.70, 0.941, 0.02), 2)
ALIGNED_TRIES_TRIED = (1, 2, 3, 4, 6, 8)  # and every pair (None)
# The speed index's planted pairs for the aligned check, as shares of its items: off-centre crops of a
# photo and other photos of the same thing, both above the aligned cosine (half B's real rate: its
# aligned checks per image, reported beside).
SPEED_CROPS, SPEED_SIBLINGS = 0.03, 0.10
RESULTS = Path(__file__).parent / "results"


def evaluate_half(data: dict, half: str, work: Path, chosen: TierSettings | None = None) -> dict:
    """``chosen`` None (half A): the grids of settings; else everything at ``chosen``."""
    index, members = half_index(data, half, work)
    records = data["records"]
    loosest = TierSettings(
        edited_cosine=float(EDITED_COSINES[0]),
        edited_bits=max(EDITED_BITS_TRIED),
        similar_cosine=float(SIMILAR_COSINES[0]),
    )
    true_counts = all_true_pairs(records, members)
    result: dict = {"images": len(members), "true_pairs": {t.label: int(true_counts[t]) for t in Tier}}
    if chosen is None:
        pairs, _ = tier_pairs(index, Tier.SIMILAR, loosest, digests_for(data))
        firsts, seconds = record_of(index, pairs.firsts), record_of(index, pairs.seconds)
        truth = true_tiers(records, firsts, seconds)
        exact = pairs.tiers == Tier.EXACT
        grid = {}
        for bits in EDITED_BITS_TRIED:
            for cosine in EDITED_COSINES:
                settings = TierSettings(
                    edited_cosine=float(cosine), edited_bits=bits, similar_cosine=float(SIMILAR_COSINES[0])
                )
                tiers = np.where(
                    exact, Tier.EXACT, classify(pairs.bits, pairs.turned, pairs.cosines, settings)
                )
                scores = pair_scores(tiers, truth, true_counts)
                keep = tiers <= Tier.EDITED
                groups = [
                    record_of(index, g.ids)
                    for g in group_pairs(pairs.firsts[keep], pairs.seconds[keep], pairs.cosines[keep])
                ]
                bad, photos = false_edited_images(records, members, groups)
                grid[f"{cosine:.2f}/{bits}"] = scores["edited"] | {"false_edited_images": bad / photos}
        # The similar tier holds the pairs the edited tier leaves: tried at the edited settings chosen here.
        edited = choose_edited(grid)
        similar_grid = {}
        for cosine in SIMILAR_COSINES:
            settings = TierSettings(
                similar_cosine=float(cosine),
                edited_cosine=edited["edited_cosine"],
                edited_bits=edited["edited_bits"],
            )
            tiers = np.where(exact, Tier.EXACT, classify(pairs.bits, pairs.turned, pairs.cosines, settings))
            similar_grid[f"{cosine:.2f}"] = pair_scores(tiers, truth, true_counts)["similar"]
        result |= {"edited_grid": grid, "similar_grid": similar_grid}
        result["aligned_grid"] = aligned_grid(data, index, members, edited, true_counts)
        aligned = choose_aligned(result["aligned_grid"]["grid"])
        settings = TierSettings(
            edited_cosine=edited["edited_cosine"],
            edited_bits=edited["edited_bits"],
            aligned_cosine=aligned["aligned_cosine"],
            aligned_ncc=aligned["aligned_ncc"],
        )
        result["aligned_tries"] = aligned_tries(data, index, members, settings)
    else:
        started = time.perf_counter()
        found = find_tiered(index, Tier.SIMILAR, chosen, digests=digests_for(data))
        pairs, _ = tier_pairs(index, Tier.SIMILAR, chosen, digests_for(data))
        result["find_tiered_s"] = round(time.perf_counter() - started, 2)
        firsts, seconds = record_of(index, pairs.firsts), record_of(index, pairs.seconds)
        truth = true_tiers(records, firsts, seconds)
        result["pairs"] = pair_scores(pairs.tiers, truth, true_counts)
        result["aligned_checks"] = pairs.aligned_checks
        edited = find_tiered(index, Tier.EDITED, chosen, digests=digests_for(data))
        grouped = grouped_with_photo(records, members, index, edited.groups)
        views_found = find_tiered(
            index, Tier.EDITED, replace(chosen, aligned_ncc=None), digests=digests_for(data)
        )
        grouped_by_views = grouped_with_photo(records, members, index, views_found.groups)
        # Without the aligned check: what the signature's views alone find.
        views_only, _ = tier_pairs(index, Tier.EDITED, replace(chosen, aligned_ncc=None), digests_for(data))
        result["views_only"] = {
            "edited": pair_scores(
                views_only.tiers,
                true_tiers(
                    records, record_of(index, views_only.firsts), record_of(index, views_only.seconds)
                ),
                true_counts,
            )["edited"],
        }
        # Recall of each kind of copy: its pair with its photo classified edited or stricter.
        by_kind = {}
        for kind in ("lossless", *EDITS, "take"):
            wanted = Tier.EXACT if kind == "lossless" else Tier.SIMILAR if kind == "take" else Tier.EDITED
            copies = [
                i
                for i in members
                if records[i]["kind"] == kind and not records[i]["source"].startswith("demo:motorcycle")
            ]
            hit = 0
            for i in copies:
                original = next(
                    j
                    for j in members
                    if records[j]["source"] == records[i]["source"] and records[j]["kind"] == "original"
                )
                a, b = min(i, original), max(i, original)
                match = (firsts == a) & (seconds == b) | (firsts == b) & (seconds == a)
                hit += bool(match.any() and pairs.tiers[match].min() <= wanted)
            by_kind[kind] = {
                "copies": len(copies),
                "found_at_its_tier_or_stricter": hit / len(copies) if copies else None,
                "in_its_photos_edited_group": grouped[kind],
                "in_its_photos_edited_group_views_only": grouped_by_views[kind],
            }
        result["by_kind"] = by_kind
        groups = [record_of(index, g.ids) for g in edited.groups]
        bad, photos = false_edited_images(records, members, groups)
        result["false_edited_images"] = {"images": bad, "photos": photos, "share": bad / photos}
        result["groups"] = {
            tier.label: len(find_tiered(index, tier, chosen, digests=digests_for(data)).groups)
            for tier in Tier
        }
        result["similar_groups_found"] = len(found.groups)
        bad, photos = false_edited_images(records, members, [record_of(index, g.ids) for g in found.groups])
        result["false_similar_images"] = {"images": bad, "photos": photos, "share": bad / photos}
    index.close()
    return result


def grouped_with_photo(records: list[dict], members: list[int], index: GalleryIndex, groups) -> dict:
    """Per kind of edit, the share of copies in the same group as their photo (demo motorcycle aside)."""
    group_of = {int(i): n for n, g in enumerate(groups) for i in record_of(index, g.ids)}
    originals = {records[j]["source"]: j for j in members if records[j]["kind"] == "original"}
    shares = {}
    for kind in ("lossless", *EDITS, "take"):
        copies = [
            i
            for i in members
            if records[i]["kind"] == kind and not records[i]["source"].startswith("demo:motorcycle")
        ]
        together = [
            i in group_of and group_of[i] == group_of.get(originals[records[i]["source"]]) for i in copies
        ]
        shares[kind] = float(np.mean(together)) if copies else None
    return shares


def aligned_tries(data: dict, index: GalleryIndex, members: list[int], settings: TierSettings) -> dict:
    """The fewest pairs checked between two signature groups whose edited copies are grouped with their
    photo (mean over the edit kinds) within 1 point of checking every pair (None: none tried is), at
    ``settings``."""
    rows = {}
    for tries in (*ALIGNED_TRIES_TRIED, None):
        found = find_tiered(
            index, Tier.EDITED, replace(settings, aligned_tries=tries), digests=digests_for(data)
        )
        shares = grouped_with_photo(data["records"], members, index, found.groups)
        rows[str(tries)] = {
            "grouped": float(np.mean([shares[k] for k in EDITS])),
            "checks": found.aligned_checks,
        }
    every = rows["None"]["grouped"]
    chosen = next((t for t in ALIGNED_TRIES_TRIED if rows[str(t)]["grouped"] >= every - 0.01), None)
    return {"rows": rows, "chosen": chosen}


def aligned_grid(
    data: dict, index: GalleryIndex, members: list[int], edited: dict, true_counts: np.ndarray
) -> dict:
    """The edited tier by the aligned check's (cosine, NCC) at the edited setting chosen, every pair between
    two signature groups checked: ``tier_pairs`` itself at each setting, since which aligned pairs join
    depends on the cut (each window joins only its best holder: ``engine.duplicates.tiers``)."""
    records = data["records"]
    grid, checked = {}, 0
    for cosine in ALIGNED_COSINES:
        for cut in ALIGNED_NCCS:
            settings = TierSettings(
                edited_cosine=edited["edited_cosine"],
                edited_bits=edited["edited_bits"],
                aligned_cosine=float(cosine),
                aligned_ncc=float(cut),
                aligned_tries=None,  # the check itself: how few pairs suffice is chosen after (aligned_tries)
            )
            pairs, _ = tier_pairs(index, Tier.EDITED, settings, digests_for(data))
            checked = max(checked, pairs.aligned_checks)
            truth = true_tiers(records, record_of(index, pairs.firsts), record_of(index, pairs.seconds))
            found = group_pairs(pairs.firsts, pairs.seconds, pairs.cosines)
            groups = [record_of(index, group.ids) for group in found]
            bad, photos = false_edited_images(records, members, groups)
            grid[f"{cosine:.3f}/{cut:.2f}"] = pair_scores(pairs.tiers, truth, true_counts)["edited"] | {
                "false_edited_images": bad / photos
            }
    return {"checked": checked, "grid": grid}


def choose_aligned(grid: dict) -> dict:
    """The aligned setting of the highest recall with precision >= the goal and <= 1% false edited images
    (the highest recall of all where none does); among equals the strictest (highest NCC, then cosine)."""
    allowed = [
        k
        for k, r in grid.items()
        if r["precision"] >= PRECISION_GOAL and r["false_edited_images"] <= FALSE_IMAGE_GOAL
    ]

    def rank(key: str) -> tuple:
        cosine, cut = key.split("/")
        return grid[key]["recall"], float(cut), float(cosine)

    pool = allowed or list(grid)
    cosine, cut = max(pool, key=rank).split("/")
    return {
        "aligned_cosine": float(cosine),
        "aligned_ncc": float(cut),
        "aligned_goals_met_on_a": bool(allowed),
    }


def choose_edited(grid: dict) -> dict:
    """The edited setting of the highest recall among those meeting the goals (the highest precision where
    none does); among equals the strictest (fewest bits, then highest cosine): the margin costs nothing
    on A and guards B."""
    allowed = [
        k
        for k, r in grid.items()
        if r["precision"] >= PRECISION_GOAL and r["false_edited_images"] <= FALSE_IMAGE_GOAL
    ]
    pool = allowed or list(grid)

    def rank(key: str) -> tuple:
        cosine, bits = key.split("/")
        return grid[key]["recall"], grid[key]["precision"], -int(bits), float(cosine)

    cosine, bits = max(pool, key=rank).split("/")
    return {"edited_cosine": float(cosine), "edited_bits": int(bits), "edited_goals_met_on_a": bool(allowed)}


def choose(half_a: dict) -> dict:
    similar = max(
        half_a["similar_grid"],
        key=lambda k: min(half_a["similar_grid"][k]["precision"], half_a["similar_grid"][k]["recall"]),
    )
    return (
        choose_edited(half_a["edited_grid"])
        | {"similar_cosine": float(similar)}
        | choose_aligned(half_a["aligned_grid"]["grid"])
        | {"aligned_tries": half_a["aligned_tries"]["chosen"]}
    )


def speed(data: dict, count: int, seed: int, work: Path, settings: TierSettings) -> dict:
    index, planted, built_s = synthetic_index(
        data["vectors"], count, seed, work, crops=SPEED_CROPS, siblings=SPEED_SIBLINGS
    )
    result = {
        "items": len(index),
        "dim": index.manifest.dim,
        "index": index.manifest.built.index_spec,
        "build_s": round(built_s, 1),
        "planted_copies": planted,
    }
    for tier in (Tier.EDITED, Tier.SIMILAR):
        started = time.perf_counter()
        found = find_tiered(index, tier, settings)
        result[f"{tier.label}_s"] = round(time.perf_counter() - started, 2)
        result[f"{tier.label}_groups"] = len(found.groups)
        result[f"{tier.label}_aligned_checks"] = found.aligned_checks
    index.close()
    return result


def tries_checked(tries: int | None) -> str:
    return "every pair" if tries is None else f"at most {tries} pairs"


def half_lines(b: dict, heading: str) -> list[str]:
    """The markdown of one evaluation of a half at given settings."""
    pairs = b["pairs"]
    lines = [
        f"## {heading} (find_tiered)",
        "",
        "Pairs classified per tier (each pair its strictest tier):",
        "",
        "| tier | precision | recall | pairs found | true pairs | precision, this tier or stricter "
        "| recall, this tier or stricter |",
        "|---|---|---|---|---|---|---|",
    ]
    for tier, row in pairs.items():
        lines.append(
            f"| {tier} | {row['precision']:.4f} | {row['recall']:.4f} | {row['found_pairs']} "
            f"| {row['true_pairs']} "
            f"| {row['at_most_precision']:.4f} | {row['at_most_recall']:.4f} |"
        )
    false = b["false_edited_images"]
    views = b["views_only"]["edited"]
    lines += [
        "",
        f"Edited pairs: precision **{pairs['edited']['precision']:.4f}**, recall "
        f"{pairs['edited']['recall']:.4f} (a take with its photo counts as a false edit: the simulated take "
        f"is another window of the photo's source, {TAKE_WINDOW[0] - PHOTO_WINDOW[0]:.1%} further right and "
        f"{TAKE_WINDOW[1] - PHOTO_WINDOW[1]:.1%} further down, seen from a camera turned by a homography, "
        "5% brighter: neither image is a window of the other). The signature's views alone (no aligned "
        f"check): edited precision {views['precision']:.4f}, recall {views['recall']:.4f}. Pairs the aligned "
        f"check looked at: {b['aligned_checks']} ({b['aligned_checks'] / b['images']:.2f} per "
        "image).",
        "",
        f"Cars196 photos in an edited group with another photo (goal <= 1%): **{false['images']} of "
        f"{false['photos']} = {100 * false['share']:.2f}%**.",
        "",
        "Each kind of copy found with its photo at its tier or stricter (lossless: exact; take: similar; "
        "others: edited), and in its photo's group of the edited tier (what a person reviewing the edited "
        "tier sees; a take there is a false edit):",
        "",
        "| kind | copies | pair found | in its photo's edited group | the same, signature views alone |",
        "|---|---|---|---|---|",
    ]
    for kind, row in b["by_kind"].items():
        share = (
            "-"
            if row["found_at_its_tier_or_stricter"] is None
            else f"{row['found_at_its_tier_or_stricter']:.3f}"
        )
        grouped, alone = row["in_its_photos_edited_group"], row["in_its_photos_edited_group_views_only"]
        lines.append(
            f"| {kind} | {row['copies']} | {share} | {'-' if grouped is None else f'{grouped:.3f}'} "
            f"| {'-' if alone is None else f'{alone:.3f}'} |"
        )
    similar = b["false_similar_images"]
    return [
        *lines,
        "",
        f"Cars196 photos in a similar group with another photo (another car of the same model, or another "
        f"scene): {similar['images']} of {similar['photos']} = {100 * similar['share']:.2f}%.",
        "",
        f"Groups per tier: {b['groups']}.",
        "",
    ]


def write_markdown(result: dict, path: Path) -> None:
    b, chosen, args = result["half_b"], result["chosen_on_a"], result["args"]
    lines = [
        "# Duplicate tiers (bench/duplicate_tiers.py)",
        "",
        f"Command: `{result['command']}` (load average when it started: {result['load']}; the machine "
        "was shared with other jobs: times are indicative)",
        "",
        f"Images: half A {result['half_a']['images']}, half B {b['images']} (Cars196 test photos of "
        f"{args['classes']} car models, {args['per_class']} each, models split in two halves; "
        f"{args['sources']} photos per half with {len(KINDS) - 1} copies each; half B also the demo "
        "gallery's photos with their copies).",
        "",
        f"Chosen on half A: edited cosine >= {chosen['edited_cosine']}, signatures within "
        f"{chosen['edited_bits']} bits; similar cosine >= {chosen['similar_cosine']} (edited goals met on A: "
        f"{chosen['edited_goals_met_on_a']}); the aligned check: cosine >= {chosen['aligned_cosine']} and "
        f"aligned NCC >= {chosen['aligned_ncc']} (aligned goals met on A: "
        f"{chosen['aligned_goals_met_on_a']}, see below), {tries_checked(chosen['aligned_tries'])} checked "
        "between two signature groups (see below). Library defaults when measured: edited "
        f"{EDITED_COSINE}/{EDITED_BITS} (cosine {TURNED_COSINE} through a turned view), similar "
        f"{SIMILAR_COSINE} (bits <= {SIMILAR_BITS}), aligned "
        f"{ALIGNED_COSINE}/{ALIGNED_NCC}, {ALIGNED_TRIES} tries.",
        "",
        *half_lines(b, "Half B, at the settings chosen on half A"),
        *half_lines(result["half_b_defaults"], "Half B, at the library's defaults"),
        *half_lines(
            result["half_a_defaults"], "Half A, at the library's defaults (where nothing was chosen)"
        ),
        "## Half A: the edited tier by cosine / bits",
        "",
        "| cosine/bits | precision | recall | false edited images |",
        "|---|---|---|---|",
    ]
    for key, row in result["half_a"]["edited_grid"].items():
        lines.append(
            f"| {key} | {row['precision']:.4f} | {row['recall']:.4f} "
            f"| {100 * row['false_edited_images']:.2f}% |"
        )
    aligned = result["half_a"]["aligned_grid"]
    lines += [
        "",
        f"## Half A: the aligned check by cosine / NCC (at the edited setting chosen; {aligned['checked']} "
        "pairs checked)",
        "",
        "| cosine/NCC | precision | recall | false edited images |",
        "|---|---|---|---|",
    ]
    for key, row in aligned["grid"].items():
        lines.append(
            f"| {key} | {row['precision']:.4f} | {row['recall']:.4f} "
            f"| {100 * row['false_edited_images']:.2f}% |"
        )
    tries = result["half_a"]["aligned_tries"]
    lines += [
        "",
        "## Half A: pairs checked between two signature groups (at the aligned setting chosen)",
        "",
        "Chosen: the fewest whose edited copies are grouped with their photo (mean over the edit kinds) "
        f"within 1 point of checking every pair: **{tries_checked(tries['chosen'])}**.",
        "",
        "| at most | copies grouped with their photo | pairs checked |",
        "|---|---|---|",
    ]
    for key, row in tries["rows"].items():
        lines.append(f"| {'every pair' if key == 'None' else key} | {row['grouped']:.3f} | {row['checks']} |")
    lines += [
        "",
        "## Half A: the similar tier by cosine",
        "",
        "| cosine | precision | recall |",
        "|---|---|---|",
    ]
    for key, row in result["half_a"]["similar_grid"].items():
        lines.append(f"| {key} | {row['precision']:.4f} | {row['recall']:.4f} |")
    lines += ["", "## Speed", ""]
    for key, settings in (
        ("speed", "the settings chosen on half A"),
        ("speed_defaults", "the library's defaults"),
    ):
        s = result[key]
        lines += [
            f"At {settings} (`{s['command']}`, load average {s['load']}): {s['items']} synthetic vectors "
            f"({s['dim']}-d, from this bench's embeddings; index `{s['index']}`, built in {s['build_s']} s, "
            "not counted; signatures with thumbnails; planted for the aligned check: off-centre crops of "
            f"{SPEED_CROPS:.0%} and other photos of the same thing for {SPEED_SIBLINGS:.0%} of the items): "
            f"all groups of the edited tier in **{s['edited_s']} s** ({s['edited_groups']} groups, "
            f"{s['edited_aligned_checks']} aligned checks = "
            f"{s['edited_aligned_checks'] / s['items']:.2f} per item; half B: "
            f"{b['aligned_checks'] / b['images']:.2f}), of the similar tier in "
            f"**{s['similar_s']} s** ({s['similar_groups']} groups); goal < 60 s.",
            "",
        ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option(),
        model_option(required=True),
        seed_option(),
        out_option(RESULTS / "duplicate_tiers"),
    )
    parser.add_argument("--classes", type=int, default=98)
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--sources", type=int, default=100)
    parser.add_argument("--speed-items", type=int, default=100_000)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "duplicate_tiers.npz")
    parser.add_argument("--speed-only", action="store_true", help="rerun the speed part, keep the rest")
    args = parser.parse_args()
    sizes = f"{args.classes}|{args.per_class}|{args.sources}|{args.seed}|{','.join(KINDS)}"
    # The images are as current as the code that makes them.
    image_code = hashlib.sha256(
        "".join(inspect.getsource(f) for f in (bench_images, make_copy, photo_window, second_take)).encode()
        + repr((PHOTO_WINDOW, TAKE_WINDOW, TAKE_TURN)).encode()
    ).hexdigest()
    # The signatures are as current as the module that computes them.
    signature_code = hashlib.sha256(inspect.getsource(signature_module).encode()).hexdigest()
    key = f"{args.data.resolve()}|{args.model.resolve()}|{sizes}|{image_code}|{signature_code}"
    cached_key = str(np.load(args.cache)["key"]) if args.cache.exists() else ""
    if cached_key.rsplit("|", 1)[0] == key.rsplit("|", 1)[0]:  # the same images and model
        cached = np.load(args.cache)
        data = {"records": json.loads(str(cached["records"])), "vectors": cached["vectors"]}
        if cached_key != key:
            resign(args, data, Embedder(args.model).card.preprocessing.resize_size)
            np.savez(
                args.cache,
                key=np.array(key),
                records=np.array(json.dumps(data["records"])),
                vectors=data["vectors"],
            )
    else:
        data = build_items(args, Embedder(args.model))
        np.savez(
            args.cache,
            key=np.array(key),
            records=np.array(json.dumps(data["records"])),
            vectors=data["vectors"],
        )
    if args.speed_only:
        result = json.loads(args.out.with_suffix(".json").read_text())
        measure_speed(result, data, args)
        write_results(result, args.out)
        return
    result = {
        "command": "python " + " ".join(sys.argv),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "args": {
            "classes": args.classes,
            "per_class": args.per_class,
            "sources": args.sources,
            "seed": args.seed,
        },
    }
    with tempfile.TemporaryDirectory() as work:
        result["half_a"] = evaluate_half(data, "A", Path(work) / "a")
        result["chosen_on_a"] = choose(result["half_a"])
        result["library_defaults"] = {
            "edited_cosine": EDITED_COSINE,
            "turned_cosine": TURNED_COSINE,
            "edited_bits": EDITED_BITS,
            "similar_cosine": SIMILAR_COSINE,
            "aligned_cosine": ALIGNED_COSINE,
            "aligned_ncc": ALIGNED_NCC,
            "aligned_tries": ALIGNED_TRIES,
        }
        result["half_b"] = evaluate_half(data, "B", Path(work) / "b", chosen_settings(result["chosen_on_a"]))
        result["half_b_defaults"] = evaluate_half(data, "B", Path(work) / "b_defaults", TierSettings())
        result["half_a_defaults"] = evaluate_half(data, "A", Path(work) / "a_defaults", TierSettings())
    measure_speed(result, data, args)
    write_results(result, args.out)


def measure_speed(result: dict, data: dict, args: argparse.Namespace) -> None:
    """The speed part, at the settings chosen on half A and at the library's defaults, into ``result``."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    at = {"speed": chosen_settings(result["chosen_on_a"]), "speed_defaults": TierSettings()}
    with tempfile.TemporaryDirectory() as work:
        for key, settings in at.items():
            result[key] = speed(data, args.speed_items, args.seed, Path(work) / key, settings)
            result[key] |= {"command": "python " + " ".join(sys.argv), "load": load}


def chosen_settings(chosen: dict) -> TierSettings:
    return TierSettings(
        edited_cosine=chosen["edited_cosine"],
        edited_bits=chosen["edited_bits"],
        similar_cosine=chosen["similar_cosine"],
        aligned_cosine=chosen["aligned_cosine"],
        aligned_ncc=chosen["aligned_ncc"],
        aligned_tries=chosen["aligned_tries"],
    )


def write_results(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
