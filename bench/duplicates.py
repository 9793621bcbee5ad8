"""Near-duplicate detection: pair precision and recall on real photos, and time to group 100k items.

    python bench/duplicates.py --data CARS196 --model artifacts/model/model.onnx

1. Quality. The Cars196 test images (``dml_split`` test in labels.csv) plus generated near-duplicates of
   a random sample of them: re-encoded (JPEG q=60), resized to half, centre-cropped to 90%, mirrored, and
   brightness +15% and -15%. Each image is embedded and gets its perceptual signature as build-index
   would (``engine.duplicates.signature``; the photos decoded with the JPEG draft, as build-index does). A
   true pair is two images made from the same photo (the photo and a copy, or two copies); every other pair
   ``dmlsearch duplicates`` reports counts against precision, pairs of distinct Cars196 files included
   (Cars196 holds some photos twice, mirrored: they count as false pairs here). The sampled photos are
   split in two halves, each run as its own gallery (all test photos plus that half's copies): the
   defaults are chosen on the first (the highest min(precision, recall)), and precision and recall at the
   library's defaults are reported on the second, by ``find_duplicates`` itself. Also reported: the same
   with the embedding alone (signatures ignored, as for an index built before them). Embeddings and
   signatures are cached in ``--cache`` (delete it to re-embed; the signatures alone are computed again
   when engine/duplicates/signature.py changed).
2. Speed. ``engine.duplicates.groups.find_duplicates`` at its defaults over an index of 100k vectors of the
   model's dimension made from the real embeddings of part 1: each a real test photo's embedding plus
   Gaussian noise (about 0.85 cosine to it, like another photo of that car), with random signatures and
   smooth random thumbnails, plus 2-3 copies of 5% of them at about 0.97 cosine that share their signature
   (but for 2 flipped bits) and thumbnail;
   built with the automatic index choice as build-index would; the time excludes building the index.

Writes ``bench/results/duplicates.{json,md}``.
"""

from __future__ import annotations

import csv
import hashlib
import inspect
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from lib.duplicate_sets import synthetic_index
from lib.options import bench_parser, data_option, model_option, out_option, seed_option, threads_option
from PIL import Image, ImageEnhance, ImageOps
from tqdm import tqdm

from engine.decode.images import decode_image
from engine.duplicates import signature as signature_module
from engine.duplicates.groups import (
    DEFAULT_MAX_DISTANCE,
    DEFAULT_NEIGHBOURS,
    DEFAULT_THRESHOLD,
    EMBEDDING_ONLY_THRESHOLD,
    SignatureTable,
    candidate_pairs,
    find_duplicates,
    group_pairs,
    pair_cosines,
    signature_pairs,
)
from engine.duplicates.signature import perceptual_signature
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex
from index.protocol import Entry

VARIANTS = ("reencoded", "resized", "cropped90", "mirrored", "brighter15", "darker15")
THRESHOLDS = np.round(np.arange(0.70, 0.991, 0.01), 2)  # cosine cuts tried
DISTANCES = (4, 6, 8, 10)  # signature bits tried
RESULTS = Path(__file__).parent / "results"


def make_variant(image: Image.Image, kind: str) -> Image.Image:
    if kind == "reencoded":
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=60)
        return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    if kind == "resized":
        return image.resize((max(1, image.width // 2), max(1, image.height // 2)), Image.Resampling.LANCZOS)
    if kind == "cropped90":
        dx, dy = round(image.width * 0.05), round(image.height * 0.05)
        return image.crop((dx, dy, image.width - dx, image.height - dy))
    if kind == "mirrored":
        return ImageOps.mirror(image)
    factor = {"brighter15": 1.15, "darker15": 0.85}[kind]
    return ImageEnhance.Brightness(image).enhance(factor)


def test_photos(data: Path, sources: int, seed: int) -> tuple[list[str], np.ndarray]:
    """The Cars196 test photos and the positions of the ``sources`` sampled to make copies of."""
    with (data / "labels.csv").open() as handle:
        paths = [row["path"] for row in csv.DictReader(handle) if row["dml_split"] == "test"]
    return paths, np.sort(np.random.default_rng(seed).choice(len(paths), size=sources, replace=False))


def images(data: Path, paths: list[str], sampled: np.ndarray, draft: int, what: str) -> Iterator[tuple]:
    """``(photo, its copies)`` for every test photo, decoded as build-index decodes (with the JPEG draft);
    the copies (of the sampled photos only, else empty) are made from the full decode."""
    chosen = set(sampled.tolist())
    for position, path in enumerate(tqdm(paths, desc=what, unit="img")):
        encoded = (data / path).read_bytes()
        photo = decode_image(encoded, draft_size=draft)
        full = decode_image(encoded) if position in chosen else None
        yield photo, [make_variant(full, kind) for kind in VARIANTS] if full is not None else []


def signatures_of(data: Path, paths: list[str], sampled: np.ndarray, draft: int) -> dict[str, np.ndarray]:
    originals, copies = [], []
    for photo, variants in images(data, paths, sampled, draft, "signatures"):
        originals.append(perceptual_signature(photo))
        copies.extend(perceptual_signature(copy) for copy in variants)
    return {"original_signatures": _signature_array(originals), "copy_signatures": _signature_array(copies)}


def embed_dataset(data: Path, embedder: Embedder, sources: int, seed: int, cache: Path) -> dict:
    """Embeddings and signatures of every test photo and of the copies of ``sources`` sampled photos.

    Cached; the signatures are computed again when engine/duplicates/signature.py changed (the embeddings are
    kept)."""
    paths, sampled = test_photos(data, sources, seed)
    draft = embedder.card.preprocessing.resize_size
    # The signatures are as current as the module that computes them.
    signature_code = hashlib.sha256(inspect.getsource(signature_module).encode()).hexdigest()
    result = dict(np.load(cache, allow_pickle=False)) if cache.exists() else {}
    if not result or int(result["sources"]) != sources or int(result["seed"]) != seed:
        originals, copies, batch = [], [], []
        for photo, variants in images(data, paths, sampled, draft, "embedding test photos"):
            batch.append(photo)
            copies.extend(variants)
            if len(batch) == 32:
                originals.append(embedder.embed(batch))
                batch = []
        originals.append(embedder.embed(batch))
        copy_vectors = [
            embedder.embed(copies[start : start + 32])
            for start in tqdm(range(0, len(copies), 32), desc="embedding copies", unit="batch")
        ]
        result = {
            "originals": np.concatenate(originals),
            "copies": np.concatenate(copy_vectors),
            "copy_source": np.repeat(sampled, len(VARIANTS)),
            "sampled": sampled,
            "sources": np.array(sources),
            "seed": np.array(seed),
        }
    if str(result.get("signature_code")) != signature_code:
        result |= signatures_of(data, paths, sampled, draft) | {"signature_code": np.array(signature_code)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **result)
    return result


def _signature_array(signatures: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(signatures), dtype=np.uint8).reshape(len(signatures), -1)


def gallery(data: dict, in_half: np.ndarray, work: Path) -> tuple[GalleryIndex, dict[int, int]]:
    """An index of every test photo plus the copies ``in_half`` selects, and the photo each item is of."""
    vectors = np.concatenate([data["originals"], data["copies"][in_half]])
    signatures = np.concatenate([data["original_signatures"], data["copy_signatures"][in_half]])
    # Ground truth: the photo each vector was made from (originals: themselves).
    source = np.concatenate([np.arange(len(data["originals"])), data["copy_source"][in_half]])
    index = GalleryIndex.create(work, dim=vectors.shape[1], model_fingerprint="bench", gallery_root=None)
    entries = [Entry(f"{i}.jpg", None, str(i)) for i in range(len(vectors))]
    ids = index.add(vectors, entries, [row.tobytes() for row in signatures])
    index.save()
    return index, dict(zip(ids, source.tolist(), strict=True))


def score_groups(groups: list, source_of: dict[int, int]) -> dict:
    """Pair precision and recall of ``groups`` against the photos the items were made from."""
    group_sizes = np.bincount(list(source_of.values()))
    true_pairs = int((group_sizes * (group_sizes - 1) // 2).sum())
    found = correct = 0
    for group in groups:
        members = np.array([source_of[int(i)] for i in group.ids])
        sizes = np.bincount(np.unique(members, return_inverse=True)[1])
        found += len(members) * (len(members) - 1) // 2
        correct += int((sizes * (sizes - 1) // 2).sum())
    return {
        "precision": correct / found if found else 1.0,
        "recall": correct / true_pairs,
        "found_pairs": found,
        "true_pairs": true_pairs,
        "false_pairs": found - correct,
    }


def pair_quality(index: GalleryIndex, source_of: dict[int, int]) -> dict:
    """Pair precision and recall at every threshold and signature distance (``None``: the embedding
    alone), each from the pairs find_duplicates would keep, found once at the loosest settings."""
    signatures = SignatureTable(index.signatures())
    firsts, seconds, bits = signature_pairs(signatures, max(DISTANCES))
    cosines = pair_cosines(index, firsts, seconds)
    rows = {}
    for distance in DISTANCES:
        for threshold in THRESHOLDS:
            keep = (cosines >= threshold) & (bits <= distance)
            groups = group_pairs(firsts[keep], seconds[keep], cosines[keep])
            rows[f"{threshold:.2f}/{distance}"] = score_groups(groups, source_of)
    firsts, seconds, cosines = candidate_pairs(index, float(THRESHOLDS[0]))
    for threshold in THRESHOLDS:  # as for an index built before signatures
        keep = cosines >= threshold
        groups = group_pairs(firsts[keep], seconds[keep], cosines[keep])
        rows[f"{threshold:.2f}/None"] = score_groups(groups, source_of)
    return rows


def choose(rows: dict, distances: list[str]) -> str:
    """The ``threshold/distance`` with the highest min(precision, recall) among those distances (ties: the
    fewest bits, then the lowest threshold: the most margin for copies the embedding moves further)."""

    def rank(key: str) -> tuple[float, int, float]:
        threshold, distance = key.split("/")
        bits = 0 if distance == "None" else int(distance)
        return min(rows[key]["precision"], rows[key]["recall"]), -bits, -float(threshold)

    return max((key for key in rows if key.split("/")[1] in distances), key=rank)


def speed(real: np.ndarray, count: int, seed: int, work: Path) -> dict:
    """Time find_duplicates at its defaults over ``count`` vectors made from ``real`` embeddings."""
    index, planted, built_s = synthetic_index(real, count, seed, work)
    started = time.perf_counter()
    found = find_duplicates(index)
    seconds = time.perf_counter() - started
    result = {
        "items": len(index),
        "dim": index.manifest.dim,
        "index": index.manifest.built.index_spec,
        "search_params": index.manifest.built.search_params,
        "build_s": round(built_s, 1),
        "find_duplicates_s": round(seconds, 2),
        "groups": len(found.groups),
        "grouped_items": int(sum(len(g.ids) for g in found.groups)),
        "planted_copies": planted,
    }
    index.close()
    return result


def _cell(row: dict) -> str:
    return f"{row['precision']:.3f} / {row['recall']:.3f}"


def write_markdown(result: dict, path: Path) -> None:
    held_out, alone = result["at_defaults"], result["embedding_only_at_default"]
    defaults = result["defaults"]
    lines = [
        "# Near-duplicates (bench/duplicates.py)",
        "",
        f"Command: `{result['command']}` (load average when it started: {result['load_average']})",
        "",
        f"Cars196 test photos: {result['photos']}; {result['sources']} sampled photos with "
        f"{len(VARIANTS)} copies each ({', '.join(VARIANTS)}), split into two halves of "
        f"{result['sources'] // 2}; neighbours per item {DEFAULT_NEIGHBOURS} (the kNN search of the "
        "embedding-alone fallback).",
        "",
        f"**At the library's defaults** (candidate cosine >= {defaults['threshold']}, signatures within "
        f"{defaults['max_distance']} bits), on the second half: pair precision "
        f"**{held_out['precision']:.4f}**, pair recall **{held_out['recall']:.4f}** "
        f"({held_out['found_pairs']} pairs found, {held_out['true_pairs']} true, "
        f"{held_out['false_pairs']} joining different Cars196 files: Cars196 holds some photos twice, "
        "mirrored, and those count as false pairs here).",
        "",
        f"With the embedding alone (an index built before signatures; its default cosine "
        f"{defaults['embedding_only_threshold']}), on the second half: precision {alone['precision']:.4f}, "
        f"recall {alone['recall']:.4f}.",
        "",
        f"Chosen on the first half (highest min(precision, recall)): with signatures "
        f"{result['chosen']['signatures']}, embedding alone {result['chosen']['embedding_only']} "
        "(threshold/bits).",
        "",
        "Pair precision / recall on the first half, by candidate cosine and signature distance:",
        "",
        "| cosine | " + " | ".join(f"<= {d} bits" for d in DISTANCES) + " | embedding alone |",
        "|---|" + "---|" * (len(DISTANCES) + 1),
    ]
    selection = result["selection_half"]
    for threshold in THRESHOLDS:
        cells = [_cell(selection[f"{threshold:.2f}/{d}"]) for d in (*DISTANCES, None)]
        lines.append(f"| {threshold:.2f} | " + " | ".join(cells) + " |")
    recall_by_kind = result["recall_by_variant_at_defaults"]
    speed_result = result["speed"]
    lines += [
        "",
        "Share of copies joined to their photo's group at the defaults (both halves in one gallery): "
        + ", ".join(f"{kind} {share:.3f}" for kind, share in recall_by_kind.items()),
        "",
        "## Speed",
        "",
        f"{speed_result['items']:,} vectors ({speed_result['dim']}-d: each a real Cars196 test embedding "
        "plus noise at about 0.85 cosine to it, random signatures, plus 2-3 copies at about 0.97 cosine of "
        f"5% of them sharing their signature), index `{speed_result['index']}` "
        f"{speed_result['search_params']} (built in {speed_result['build_s']} s, not counted): all groups "
        f"at the defaults in **{speed_result['find_duplicates_s']} s** ({speed_result['groups']} groups, "
        f"{speed_result['grouped_items']} items; {speed_result['planted_copies']} planted copies).",
        "",
    ]
    path.write_text("\n".join(lines))


def recall_by_variant(data: dict, work: Path) -> dict[str, float]:
    """For each kind of copy, the share joined to the group of the photo it was made from (defaults)."""
    index, source_of = gallery(data, np.ones(len(data["copies"]), dtype=bool), work)
    ids = np.array(list(source_of))
    found = find_duplicates(index)
    index.close()
    group_of = {int(i): g for g, group in enumerate(found.groups) for i in group.ids}
    originals = len(data["originals"])
    joined: dict[str, list[bool]] = {kind: [] for kind in VARIANTS}
    for position, source in enumerate(data["copy_source"]):
        copy_group = group_of.get(int(ids[originals + position]))
        joined[VARIANTS[position % len(VARIANTS)]].append(
            copy_group is not None and copy_group == group_of.get(int(ids[source]))
        )
    return {kind: float(np.mean(values)) for kind, values in joined.items()}


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("Cars196 folder with labels.csv"),
        model_option(required=True),
        seed_option(),
        threads_option(0),
        out_option(RESULTS / "duplicates"),
    )
    parser.add_argument("--sources", type=int, default=400, help="photos to make copies of")
    parser.add_argument("--speed-items", type=int, default=100_000)
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache/dmlsearch/bench/duplicates_embeddings.npz"
    )
    parser.add_argument("--speed-only", action="store_true", help="rerun the speed part, keep the rest")
    args = parser.parse_args()
    load_average = " ".join(f"{load:.2f}" for load in os.getloadavg())
    embedder = Embedder(args.model, threads=args.threads)
    data = embed_dataset(args.data, embedder, args.sources, args.seed, args.cache)
    if args.speed_only:
        result = json.loads(args.out.with_suffix(".json").read_text())
        with tempfile.TemporaryDirectory() as work:
            result["speed"] = speed(data["originals"], args.speed_items, args.seed, Path(work))
        result["speed_command"] = "python bench/duplicates.py " + " ".join(sys.argv[1:])
        result["speed"]["load_average"] = load_average
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        write_markdown(result, args.out.with_suffix(".md"))
        print(result["speed"])
        return

    first_half = set(data["sampled"][: args.sources // 2].tolist())
    in_first = np.array([s in first_half for s in data["copy_source"]])
    with tempfile.TemporaryDirectory() as work:
        index, source_of = gallery(data, in_first, Path(work) / "a")
        selection = pair_quality(index, source_of)
        index.close()
        index, source_of = gallery(data, ~in_first, Path(work) / "b")
        at_defaults = score_groups(find_duplicates(index).groups, source_of)
        # What an index without signatures finds at its default: the kNN candidates, by cosine alone.
        firsts, seconds, cosines = candidate_pairs(index, EMBEDDING_ONLY_THRESHOLD)
        embedding_only = score_groups(group_pairs(firsts, seconds, cosines), source_of)
        index.close()
        by_kind = recall_by_variant(data, Path(work) / "c")
        speed_result = speed(data["originals"], args.speed_items, args.seed, Path(work) / "speed")
    result = {
        "command": "python bench/duplicates.py " + " ".join(sys.argv[1:]),
        "load_average": load_average,
        "photos": len(data["originals"]),
        "sources": args.sources,
        "variants": list(VARIANTS),
        "defaults": {
            "threshold": DEFAULT_THRESHOLD,
            "max_distance": DEFAULT_MAX_DISTANCE,
            "embedding_only_threshold": EMBEDDING_ONLY_THRESHOLD,
        },
        "chosen": {
            "signatures": choose(selection, [str(d) for d in DISTANCES]),
            "embedding_only": choose(selection, ["None"]),
        },
        "selection_half": selection,
        "at_defaults": at_defaults,
        "embedding_only_at_default": embedding_only,
        "recall_by_variant_at_defaults": by_kind,
        "speed": speed_result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    write_markdown(result, args.out.with_suffix(".md"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
