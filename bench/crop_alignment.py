"""Why the edited tier misses off-centre crops, and what would confirm them: a measurement, not the engine.

    python bench/crop_alignment.py --data CARS196

For Cars196 test photos (``--classes`` car models per half, three photos each; halves as in
bench/duplicate_tiers.py: models split in two), one copy of the first photo per edit kind of
bench/duplicate_tiers.py, and the three pairs of different photos of one model (near-but-different). Per
pair:

- **pHash bits**: ``index.duplicates.signature_distance`` of the engine's signatures
  (``engine.signature``), the edited tier's evidence today (edited: within ``EDITED_BITS``);
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

Writes ``bench/results/crop_alignment.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from skimage.feature import match_template

from bench.duplicate_tiers import EDITS, make_copy, photo_list
from engine.images import decode_image
from engine.signature import perceptual_signature
from index.duplicate_tiers import EDITED_BITS
from index.duplicates import signature_distance

KINDS = (*EDITS, "take")
NOT_WINDOWS = ("rotated90", "mirrored")  # the signature's turned and mirrored views find those
OTHER = "other photo, same model"
CANDIDATE_CUTS = (0.8, 0.85, 0.9)
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
    rows = [np.frombuffer(perceptual_signature(image), dtype=np.uint64)[None] for image in (first, second)]
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
        images = [decode_image((args.data / path).read_bytes(), draft_size=256) for path in paths]
        thumbs = [thumbnail(image, args.size) for image in images]
        pairs = [(kind, 0, make_copy(images[0], kind)) for kind in KINDS]
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


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Off-centre crops: pHash bits against an aligned comparison (bench/crop_alignment.py)",
        "",
        f"Command: `{result['command']}` (load average when it started: {result['load']}; the machine was "
        "shared with other jobs: times are indicative)",
        "",
        f"Edited today: pHash signatures within {EDITED_BITS} bits (index.duplicate_tiers.EDITED_BITS). "
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
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--classes", type=int, default=16, help="car models per half")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--tiers-cache", type=Path, help="bench/duplicate_tiers.py's --cache")
    parser.add_argument("--out", type=Path, default=RESULTS / "crop_alignment")
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out.with_suffix(".md"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
