"""Why the edited tier misses off-centre crops, and what would confirm them: a measurement, not the engine.

    python bench/crop_alignment.py --data CARS196

For Cars196 test photos (``--classes`` car models per half, three photos each; halves as in
bench/duplicate_tiers.py: models split in two), one copy of the first photo per edit kind of
bench/duplicate_tiers.py, and the three pairs of different photos of one model (near-but-different). Per
pair:

- **pHash bits**: ``engine.duplicates.groups.signature_distance`` of the engine's signatures
  (``engine.duplicates.signature``), the edited tier's evidence today (edited: within ``EDITED_BITS``);
- **aligned NCC**: a candidate that does not depend on where the crop lies: greyscale thumbnails of
  both images (``--size`` px square), the copy's scaled to every pair of per-axis shares in ``--scales``
  of the other's, and the best normalised cross-correlation over every offset
  (``skimage.feature.match_template``), both ways round. A crop is a window of its photo at one of those
  scales and offsets; a different photo is not. It complements the signature (a quarter turn or a
  mirror is not a window: the signature's turned and mirrored views find those), hence the last column.

The NCC cut is chosen on half A (midway between its highest near-but-different pair and its lowest copy
that is a window of its photo: every kind but the quarter turn and the mirror) and applied to half B.
With ``--tiers-cache`` (bench/duplicate_tiers.py's ``--cache``, the embeddings of its images): what an aligned
check would cost where the signature cannot propose the pairs: per half, the pairs at each cosine cut (the
candidates a cosine search would hand to it), how many join different photos, and each copy kind's lowest
cosine to its photo.

And the edited tier with such a check added, end to end on bench/duplicate_tiers.py's images (its photos
and copies made again, in its order, for their thumbnails): edited pairs = the signature's pairs
(``find_tiered``'s, at the library's settings) plus the pairs with cosine >= c (every pair of the half,
not a kNN search) whose aligned NCC at 32 px >= a cut; c and the cut chosen on half A as that bench
chooses (the highest recall with precision >= 0.98 and <= 1% of photos in a false edited group),
reported on half B.

Writes ``bench/results/crop_alignment.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from lib.duplicate_sets import (
    EDITS,
    FALSE_IMAGE_GOAL,
    PRECISION_GOAL,
    all_true_pairs,
    bench_images,
    false_edited_images,
    half_index,
    make_copy,
    photo_list,
    photo_window,
    record_of,
    second_take,
    true_tiers,
)
from lib.options import bench_parser, data_option, out_option, seed_option
from PIL import Image
from skimage.feature import match_template

from engine.decode.images import decode_image
from engine.duplicates.groups import group_pairs, signature_distance
from engine.duplicates.signature import perceptual_signature
from engine.duplicates.signature_layout import views_of
from engine.duplicates.tiers import EDITED_BITS, Tier, TierSettings, tier_pairs
from engine.model.embedder import Embedder

KINDS = (*EDITS, "take")
NOT_WINDOWS = ("rotated90", "mirrored")  # the signature's turned and mirrored views find those
OTHER = "other photo, same model"
CANDIDATE_CUTS = (0.8, 0.85, 0.9)
ALIGN_SIZE, ALIGN_SCALES = 32, np.round(np.arange(0.7, 1.001, 0.1), 2)
NCC_CUTS = np.round(np.arange(0.60, 0.901, 0.02), 2)
_BATCH = 2048  # pairs per batched_ncc call
RESULTS = Path(__file__).parent / "results"


def thumbnail(image: Image.Image, size: int) -> np.ndarray:
    grey = image.convert("L").resize((size, size), Image.Resampling.LANCZOS, reducing_gap=2.0)
    return np.asarray(grey, dtype=np.float32)


def aligned_ncc(first: np.ndarray, second: np.ndarray, scales: np.ndarray) -> float:
    """The best normalised cross-correlation of either thumbnail, shrunk per axis by ``scales``, over
    every offset inside the other."""
    best = -1.0
    size = first.shape[0]
    for whole, part in ((first, second), (second, first)):
        shown = Image.fromarray(part)
        for x in scales:
            for y in scales:
                window = shown.resize((round(size * x), round(size * y)), Image.Resampling.BILINEAR)
                best = max(best, float(match_template(whole, np.asarray(window)).max()))
    return best


def batched_ncc(wholes: np.ndarray, parts: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``aligned_ncc`` one way round for many pairs at once (``(pairs, size, size)`` thumbnails): the
    correlation with every offset by one FFT per pair and scale, the window sums from summed-area tables.
    Measures what a bounded engine check would cost; equal to match_template's scores."""
    count, size, _ = wholes.shape
    spectra = np.fft.rfft2(wholes)
    sums = np.pad(wholes.astype(np.float64), ((0, 0), (1, 0), (1, 0))).cumsum(1).cumsum(2)
    squares = np.pad(wholes.astype(np.float64) ** 2, ((0, 0), (1, 0), (1, 0))).cumsum(1).cumsum(2)

    def window(table: np.ndarray, h: int, w: int) -> np.ndarray:
        return table[:, h:, w:] - table[:, :-h, w:] - table[:, h:, :-w] + table[:, :-h, :-w]

    best = np.full(count, -1.0)
    for x in scales:
        for y in scales:
            w, h = round(size * x), round(size * y)
            shrunk = [Image.fromarray(part).resize((w, h), Image.Resampling.BILINEAR) for part in parts]
            templates = np.stack([np.asarray(t) for t in shrunk]).astype(np.float64)
            templates -= templates.mean(axis=(1, 2), keepdims=True)
            norms = np.sqrt((templates**2).sum(axis=(1, 2)))
            padded = np.zeros((count, size, size))
            padded[:, :h, :w] = templates
            correlation = np.fft.irfft2(spectra * np.conj(np.fft.rfft2(padded)), s=(size, size))
            correlation = correlation[:, : size - h + 1, : size - w + 1]
            spread = np.maximum(window(squares, h, w) - window(sums, h, w) ** 2 / (w * h), 1e-9)
            scores = correlation / (np.sqrt(spread) * norms[:, None, None] + 1e-9)
            best = np.maximum(best, scores.reshape(count, -1).max(axis=1))
    return best


def bits(first: Image.Image, second: Image.Image) -> int:
    rows = [
        np.frombuffer(views_of(perceptual_signature(image)), dtype=np.uint64)[None]
        for image in (first, second)
    ]
    return int(signature_distance(*rows)[0])


def measure(args: argparse.Namespace, scales: np.ndarray) -> dict:
    photos = photo_list(args.data, 2 * args.classes, 3, args.seed)
    labels = sorted({label for _, label in photos})
    half_a = set(labels[: len(labels) // 2])
    by_label: dict[int, list[str]] = {}
    for path, label in photos:
        by_label.setdefault(label, []).append(path)
    rows: list[dict] = []
    thumbs_of_pairs: list[tuple[np.ndarray, np.ndarray]] = []
    seconds = 0.0
    for label, paths in by_label.items():
        half = "A" if label in half_a else "B"
        # As bench/duplicate_tiers.py: photos are windows of their source, copies made from the photo.
        sources = [decode_image((args.data / path).read_bytes(), draft_size=256) for path in paths]
        images = [photo_window(source) for source in sources]
        thumbs = [thumbnail(image, args.size) for image in images]
        pairs = [(kind, 0, make_copy(images[0], kind)) for kind in EDITS]
        pairs.append(("take", 0, second_take(sources[0])))
        pairs += [(OTHER, a, images[b]) for a, b in ((0, 1), (0, 2), (1, 2))]
        for kind, first, second in pairs:
            start = time.perf_counter()
            pair = (thumbs[first], thumbnail(second, args.size))
            score = aligned_ncc(*pair, scales)
            seconds += time.perf_counter() - start
            thumbs_of_pairs.append(pair)
            rows.append({"half": half, "kind": kind, "bits": bits(images[first], second), "ncc": score})
    wholes, parts = (np.stack(side) for side in zip(*thumbs_of_pairs, strict=True))
    start = time.perf_counter()
    batched = np.maximum(batched_ncc(wholes, parts, scales), batched_ncc(parts, wholes, scales))
    batched_seconds = time.perf_counter() - start
    false_a = max(r["ncc"] for r in rows if r["half"] == "A" and r["kind"] == OTHER)
    true_a = min(r["ncc"] for r in rows if r["half"] == "A" and r["kind"] not in (OTHER, *NOT_WINDOWS))
    cut = round((false_a + true_a) / 2, 3)
    per_kind = {}
    for kind in (*KINDS, OTHER):
        of_b = [r for r in rows if r["half"] == "B" and r["kind"] == kind]
        per_kind[kind] = {
            "pairs": len(of_b),
            "phash_edited": float(np.mean([r["bits"] <= EDITED_BITS for r in of_b])),
            "bits_median": float(np.median([r["bits"] for r in of_b])),
            "ncc_min": round(min(r["ncc"] for r in of_b), 3),
            "ncc_median": round(float(np.median([r["ncc"] for r in of_b])), 3),
            "ncc_over_cut": float(np.mean([r["ncc"] >= cut for r in of_b])),
            "either": float(np.mean([r["bits"] <= EDITED_BITS or r["ncc"] >= cut for r in of_b])),
        }
    return {
        "size": args.size,
        "scales": scales.tolist(),
        "cut_from_a": cut,
        "highest_false_a": round(false_a, 3),
        "lowest_window_a": round(true_a, 3),
        "ms_per_pair": round(1000 * seconds / len(rows), 1),
        "ms_per_pair_batched": round(1000 * batched_seconds / len(rows), 2),
        "batched_largest_difference": float(np.abs(batched - [r["ncc"] for r in rows]).max()),
        "half_b": per_kind,
        "rows": rows,
    }


def candidate_counts(cache: Path) -> dict:
    """Per half of bench/duplicate_tiers.py's images: pairs at each cosine cut, and each kind's lowest
    cosine to its photo."""
    stored = np.load(cache)
    records, vectors = json.loads(str(stored["records"])), stored["vectors"]
    originals = {r["source"]: i for i, r in enumerate(records) if r["kind"] == "original"}
    out: dict = {}
    for half in ("A", "B"):
        members = [i for i, r in enumerate(records) if r["half"] == half]
        upper = np.triu_indices(len(members), 1)
        cosines = (vectors[members] @ vectors[members].T)[upper]
        sources = np.array([records[i]["source"] for i in members])
        different = sources[upper[0]] != sources[upper[1]]
        out[half] = {
            "images": len(members),
            "cuts": {
                str(cut): {
                    "pairs": int((cosines >= cut).sum()),
                    "different": int((different & (cosines >= cut)).sum()),
                }
                for cut in CANDIDATE_CUTS
            },
            "lowest_cosine": {
                kind: round(
                    min(
                        float(vectors[i] @ vectors[originals[records[i]["source"]]])
                        for i in members
                        if records[i]["kind"] == kind
                    ),
                    3,
                )
                for kind in KINDS
            },
        }
    return out


def cached_thumbnails(cache: Path) -> tuple[dict, np.ndarray]:
    """bench/duplicate_tiers.py's cached records and vectors, and every image's ``ALIGN_SIZE`` thumbnail,
    made again from its settings (the cache's key)."""
    stored = np.load(cache)
    data = {"records": json.loads(str(stored["records"])), "vectors": stored["vectors"]}
    data_path, model, classes, per_class, sources, seed, *_ = str(stored["key"]).split("|")
    settings = argparse.Namespace(
        data=Path(data_path),
        classes=int(classes),
        per_class=int(per_class),
        sources=int(sources),
        seed=int(seed),
    )
    draft = Embedder(Path(model)).card.preprocessing.resize_size
    thumbs = []
    for number, (image, record) in enumerate(bench_images(settings, draft)):
        cached = data["records"][number]
        if any(cached[key] != value for key, value in record.items()):
            raise SystemExit(f"image {number} is not the cache's: {record} against {cached}")
        thumbs.append(thumbnail(image, ALIGN_SIZE))
    return data, np.stack(thumbs)


def both_ways(thumbs: np.ndarray, firsts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    scores = [np.zeros(0)]
    for start in range(0, len(firsts), _BATCH):
        a, b = thumbs[firsts[start : start + _BATCH]], thumbs[seconds[start : start + _BATCH]]
        scores.append(np.maximum(batched_ncc(a, b, ALIGN_SCALES), batched_ncc(b, a, ALIGN_SCALES)))
    return np.concatenate(scores)


def end_to_end_half(data: dict, thumbs: np.ndarray, half: str, work: Path) -> dict:
    """The signature's edited pairs, the aligned candidates with their NCC, and the scores of every
    (cosine, NCC cut) of the grid."""
    records, vectors = data["records"], data["vectors"]
    index, members = half_index(data, half, work)
    pairs, _ = tier_pairs(index, Tier.EDITED, TierSettings(aligned_ncc=None))  # the views alone
    signed = {
        (min(a, b), max(a, b))
        for a, b in zip(
            record_of(index, pairs.firsts).tolist(), record_of(index, pairs.seconds).tolist(), strict=True
        )
    }
    members_array = np.array(members)
    upper = np.triu_indices(len(members), 1)
    cosines = (vectors[members] @ vectors[members].T)[upper]
    near = cosines >= min(CANDIDATE_CUTS)
    firsts, seconds, cosines = members_array[upper[0][near]], members_array[upper[1][near]], cosines[near]
    fresh = np.array(
        [(a, b) not in signed for a, b in zip(firsts.tolist(), seconds.tolist(), strict=True)], dtype=bool
    )
    firsts, seconds, cosines = firsts[fresh], seconds[fresh], cosines[fresh]
    start = time.perf_counter()
    ncc = both_ways(thumbs, firsts, seconds)
    seconds_taken = time.perf_counter() - start
    true_count = int(all_true_pairs(records, members)[: Tier.EDITED + 1].sum())
    base = np.array(sorted(signed), dtype=np.int64).reshape(-1, 2)

    def scores(cosine: float, cut: float) -> dict:
        take = (cosines >= cosine) & (ncc >= cut)
        found = np.concatenate([base, np.stack([firsts[take], seconds[take]], axis=1)])
        truth = true_tiers(records, found[:, 0], found[:, 1]) <= Tier.EDITED
        groups = group_pairs(found[:, 0], found[:, 1], np.ones(len(found), np.float32))
        bad, photos = false_edited_images(records, members, [group.ids for group in groups])
        pairs_found = {(int(a), int(b)) for a, b in found}
        originals = {records[i]["source"]: i for i in members if records[i]["kind"] == "original"}
        kinds = {}
        for kind in EDITS:
            copies = [i for i in members if records[i]["kind"] == kind]
            kinds[kind] = float(
                np.mean(
                    [
                        (min(i, originals[records[i]["source"]]), max(i, originals[records[i]["source"]]))
                        in pairs_found
                        for i in copies
                    ]
                )
            )
        return {
            "cosine": cosine,
            "ncc": cut,
            "precision": float(truth.mean()) if len(truth) else 1.0,
            "recall": float(truth.sum() / true_count),
            "false_images": bad / photos,
            "per_kind": kinds,
        }

    grid = [scores(float(c), float(cut)) for c in CANDIDATE_CUTS for cut in NCC_CUTS]
    return {
        "images": len(members),
        "candidates": len(firsts),
        "ms_per_pair": round(1000 * seconds_taken / max(len(firsts), 1), 2),
        "signature_only": scores(1.01, 1.01),
        "grid": grid,
    }


def end_to_end(cache: Path) -> dict:
    data, thumbs = cached_thumbnails(cache)
    with tempfile.TemporaryDirectory() as work:
        half_a = end_to_end_half(data, thumbs, "A", Path(work) / "a")
        meeting = [
            g
            for g in half_a["grid"]
            if g["precision"] >= PRECISION_GOAL and g["false_images"] <= FALSE_IMAGE_GOAL
        ]
        chosen = max(meeting, key=lambda g: (g["recall"], g["cosine"], g["ncc"])) if meeting else None
        half_b = end_to_end_half(data, thumbs, "B", Path(work) / "b")
    at_b = None
    if chosen:
        at_b = next(
            g for g in half_b["grid"] if g["cosine"] == chosen["cosine"] and g["ncc"] == chosen["ncc"]
        )
    return {"half_a": half_a, "chosen_on_a": chosen, "half_b": half_b, "at_chosen_b": at_b}


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Off-centre crops: pHash bits against an aligned comparison (bench/crop_alignment.py)",
        "",
        f"Command: `{result['command']}` (load average when it started: {result['load']}; the machine was "
        "shared with other jobs: times are indicative)",
        "",
        f"Edited today: pHash signatures within {EDITED_BITS} bits (engine.duplicates.tiers.EDITED_BITS). "
        "Aligned NCC: see the bench's docstring; the cut is chosen on half A (midway between its highest "
        "near-but-different pair and its lowest copy that is a window of its photo), figures are half B's.",
    ]
    for run in result["runs"]:
        lines += [
            "",
            f"## Thumbnails {run['size']} px, per-axis scales {run['scales']}",
            "",
            f"NCC cut from half A: {run['cut_from_a']} (highest near-but-different pair on A: "
            f"{run['highest_false_a']}, lowest window copy: {run['lowest_window_a']}); "
            f"{run['ms_per_pair']} ms per pair (skimage, one pair at a time), "
            f"{run['ms_per_pair_batched']} ms batched (numpy FFT, batched_ncc; largest difference "
            f"to skimage's scores {run['batched_largest_difference']:.1e}).",
            "",
            "| kind (half B) | pairs | edited by pHash | pHash bits, median | NCC min | NCC median "
            "| NCC >= cut | pHash or NCC |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for kind, row in run["half_b"].items():
            lines.append(
                f"| {kind} | {row['pairs']} | {row['phash_edited']:.3f} | {row['bits_median']:.0f} | "
                f"{row['ncc_min']:.3f} | {row['ncc_median']:.3f} | {row['ncc_over_cut']:.3f} | "
                f"{row['either']:.3f} |"
            )
    if "candidates" in result:
        lines += [
            "",
            "## Candidates a cosine search would hand to an aligned check (duplicate_tiers images)",
            "",
            "| half | images | "
            + " | ".join(f"pairs >= {cut} (different photos)" for cut in CANDIDATE_CUTS)
            + " |",
            "|---|---|" + "---|" * len(CANDIDATE_CUTS),
        ]
        for half, counts in result["candidates"].items():
            cells = [
                f"{counts['cuts'][str(cut)]['pairs']} ({counts['cuts'][str(cut)]['different']})"
                for cut in CANDIDATE_CUTS
            ]
            lines.append(f"| {half} | {counts['images']} | " + " | ".join(cells) + " |")
        lowest = result["candidates"]["B"]["lowest_cosine"]
        lines += [
            "",
            "Lowest cosine of a copy to its photo, half B: "
            + ", ".join(f"{k} {v}" for k, v in lowest.items())
            + ".",
        ]
    if "end_to_end" in result:
        e2e = result["end_to_end"]
        chosen = e2e["chosen_on_a"]
        lines += [
            "",
            "## The edited tier with an aligned check added (duplicate_tiers images, end to end)",
            "",
        ]
        if chosen is None:
            lines.append("No setting met the goals on half A.")
        else:
            lines += [
                f"Chosen on half A by precision >= {PRECISION_GOAL}: cosine >= {chosen['cosine']}, "
                f"aligned NCC >= {chosen['ncc']} "
                f"(A: precision {chosen['precision']:.4f}, recall {chosen['recall']:.4f}, false edited "
                f"images {chosen['false_images']:.2%}). Aligned candidates (pairs >= {min(CANDIDATE_CUTS)} "
                f"not already signature pairs): A {e2e['half_a']['candidates']} "
                f"({e2e['half_a']['ms_per_pair']} ms per pair), B {e2e['half_b']['candidates']} "
                f"({e2e['half_b']['ms_per_pair']} ms per pair).",
                "",
                "| half B | precision | recall | false edited images | " + " | ".join(EDITS) + " |",
                "|---|---|---|---|" + "---|" * len(EDITS),
            ]
            for name, row in (
                ("signature only", e2e["half_b"]["signature_only"]),
                ("with the aligned check", e2e["at_chosen_b"]),
            ):
                lines.append(
                    f"| {name} | {row['precision']:.4f} | {row['recall']:.4f} | {row['false_images']:.2%} | "
                    + " | ".join(f"{row['per_kind'][kind]:.3f}" for kind in EDITS)
                    + " |"
                )
            lines += [
                "",
                "Pairs are exact-or-edited pairs; a take with its photo or its copies is a false edited "
                "pair (the simulated take is a camera move: bench/duplicate_tiers.py); the kinds' columns: "
                "each copy found with its photo.",
            ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = bench_parser(__doc__, data_option(), seed_option(3), out_option(RESULTS / "crop_alignment"))
    parser.add_argument("--classes", type=int, default=16, help="car models per half")
    parser.add_argument("--tiers-cache", type=Path, help="bench/duplicate_tiers.py's --cache")
    args = parser.parse_args()
    result: dict = {
        "command": "python " + " ".join(sys.argv),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "runs": [],
    }
    for size, step in ((64, 0.05), (32, 0.1)):
        args.size = size
        result["runs"].append(measure(args, np.round(np.arange(0.7, 1.001, step), 2)))
    if args.tiers_cache:
        result["candidates"] = candidate_counts(args.tiers_cache)
        result["end_to_end"] = end_to_end(args.tiers_cache)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out.with_suffix(".md"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
