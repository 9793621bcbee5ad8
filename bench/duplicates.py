"""Near-duplicate detection: pair precision and recall on real photos, and time to group 100k items.

    python bench/duplicates.py --data CARS196 --model artifacts/model/model.onnx

1. Quality. The Cars196 test images (``dml_split`` test in labels.csv) plus generated near-duplicates of
   a random sample of them: re-encoded (JPEG q=60), resized to half, centre-cropped to 90%, mirrored, and
   brightness +15% and -15%. A true pair is two images made from the same photo (the photo and a copy, or
   two copies); every other pair ``dmlsearch duplicates`` reports counts against precision, pairs of
   distinct Cars196 photos included. The sampled photos are split in two halves: the threshold is chosen
   on the first (the highest min(precision, recall), then the higher threshold), and precision and recall
   are reported at it on the second, each half run as its own gallery (all test photos plus that half's
   copies). Embeddings are cached in ``--cache`` (delete it to re-embed).
2. Speed. ``index.duplicates.find_duplicates`` over an index of 100k synthetic unit vectors of the model's
   dimension (200 clusters at about 0.5 cosine within a cluster, plus 2-3 copies at about 0.995 of 5% of
   them), built with the automatic index choice as build-index would; the time excludes building the index.

Writes ``bench/results/duplicates.{json,md}``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance, ImageOps
from tqdm import tqdm

from engine.embedder import Embedder
from engine.images import decode_image
from index.duplicates import DEFAULT_NEIGHBOURS, DEFAULT_THRESHOLD, find_duplicates
from index.gallery import GalleryIndex

VARIANTS = ("reencoded", "resized", "cropped90", "mirrored", "brighter15", "darker15")
THRESHOLDS = np.round(np.arange(0.80, 0.991, 0.01), 2)
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


def embed_dataset(data: Path, embedder: Embedder, sources: int, seed: int, cache: Path) -> dict:
    """Embeddings of every test photo and of the copies of ``sources`` sampled photos (cached)."""
    if cache.exists():
        loaded = np.load(cache, allow_pickle=False)
        if int(loaded["sources"]) == sources and int(loaded["seed"]) == seed:
            return dict(loaded)
    with (data / "labels.csv").open() as handle:
        paths = [row["path"] for row in csv.DictReader(handle) if row["dml_split"] == "test"]
    sampled = np.sort(np.random.default_rng(seed).choice(len(paths), size=sources, replace=False))
    draft = embedder.card.preprocessing.resize_size
    originals, copies, copy_source = [], [], []
    batch: list[Image.Image] = []
    for position, path in enumerate(tqdm(paths, desc="embedding test photos", unit="img")):
        batch.append(decode_image((data / path).read_bytes(), draft_size=draft))
        if position in set(sampled.tolist()):
            full = decode_image((data / path).read_bytes())
            copies.extend(make_variant(full, kind) for kind in VARIANTS)
            copy_source.extend([position] * len(VARIANTS))
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
        "copy_source": np.array(copy_source, dtype=np.int64),
        "sampled": sampled,
        "sources": np.array(sources),
        "seed": np.array(seed),
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **result)
    return result


def pair_quality(originals: np.ndarray, copies: np.ndarray, copy_source: np.ndarray, work: Path) -> dict:
    """Pair precision and recall of find_duplicates at every threshold, for one gallery."""
    vectors = np.concatenate([originals, copies])
    # Ground truth: the photo each vector was made from (originals: themselves).
    source = np.concatenate([np.arange(len(originals)), copy_source])
    group_sizes = np.bincount(source)
    true_pairs = int((group_sizes * (group_sizes - 1) // 2).sum())
    index = GalleryIndex.create(work, dim=vectors.shape[1], model_fingerprint="bench", gallery_root=None)
    ids = np.array(index.add(vectors, [(f"{i}.jpg", None, str(i)) for i in range(len(vectors))]))
    index.save()
    source_of = dict(zip(ids.tolist(), source.tolist(), strict=True))
    rows = {}
    for threshold in THRESHOLDS:
        found = correct = distinct_photos = 0
        for group in find_duplicates(index, float(threshold)):
            members = np.array([source_of[int(i)] for i in group.ids])
            sizes = np.bincount(np.unique(members, return_inverse=True)[1])
            pairs = len(members) * (len(members) - 1) // 2
            found += pairs
            correct += int((sizes * (sizes - 1) // 2).sum())
            distinct_photos += pairs - int((sizes * (sizes - 1) // 2).sum())
        rows[f"{threshold:.2f}"] = {
            "precision": correct / found if found else 1.0,
            "recall": correct / true_pairs,
            "found_pairs": found,
            "true_pairs": true_pairs,
            "false_pairs": distinct_photos,
        }
    index.close()
    return rows


def choose_threshold(rows: dict) -> str:
    return max(rows, key=lambda t: (min(rows[t]["precision"], rows[t]["recall"]), float(t)))


def speed(dim: int, count: int, seed: int, work: Path) -> dict:
    rng = np.random.default_rng(seed)
    originals = count - count * 5 // 100 * 5 // 2  # room for 2-3 copies of 5% of them
    centres = rng.standard_normal((200, dim))
    # Noise as large as the centres: about 0.5 cosine within a cluster, like photos of one class, far
    # below any duplicate threshold; the planted copies sit at about 0.995 from their originals.
    base = centres[rng.integers(len(centres), size=originals)] + rng.standard_normal((originals, dim))
    base = (base / np.linalg.norm(base, axis=1, keepdims=True)).astype(np.float32)
    duplicated = rng.choice(originals, size=count // 20, replace=False)
    copies = np.repeat(duplicated, rng.integers(2, 4, size=len(duplicated)))
    noise = rng.standard_normal((len(copies), dim)).astype(np.float32)
    noisy = base[copies] + 0.1 * noise / np.linalg.norm(noise, axis=1, keepdims=True)
    vectors = np.concatenate([base, noisy])  # about count items
    index = GalleryIndex.create(work, dim=dim, model_fingerprint="bench", gallery_root=None)
    for start in range(0, len(vectors), 20_000):
        chunk = vectors[start : start + 20_000]
        index.add(chunk, [(f"{start + i}", None, f"{start + i}") for i in range(len(chunk))])
    started = time.perf_counter()
    index.save()  # builds and tunes the index the automatic choice picks
    built_s = time.perf_counter() - started
    started = time.perf_counter()
    groups = find_duplicates(index, DEFAULT_THRESHOLD)
    seconds = time.perf_counter() - started
    result = {
        "items": len(vectors),
        "dim": dim,
        "index": index.manifest.index_spec,
        "search_params": index.manifest.search_params,
        "build_s": round(built_s, 1),
        "find_duplicates_s": round(seconds, 2),
        "groups": len(groups),
        "grouped_items": int(sum(len(g.ids) for g in groups)),
        "planted_copies": len(copies),
    }
    index.close()
    return result


def write_markdown(result: dict, path: Path) -> None:
    chosen = result["chosen_threshold"]
    held_out = result["evaluation_half"][chosen]
    lines = [
        "# Near-duplicates (bench/duplicates.py)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Cars196 test photos: {result['photos']}; {result['sources']} sampled photos with "
        f"{len(VARIANTS)} copies each ({', '.join(VARIANTS)}), split into two halves of "
        f"{result['sources'] // 2}; neighbours per item {DEFAULT_NEIGHBOURS}.",
        "",
        f"**Threshold chosen on the first half: {chosen}** (highest min(precision, recall)). On the second "
        f"half at {chosen}: pair precision **{held_out['precision']:.4f}**, pair recall "
        f"**{held_out['recall']:.4f}** ({held_out['found_pairs']} pairs found, {held_out['true_pairs']} "
        f"true, {held_out['false_pairs']} joining different photos).",
        "",
        "| threshold | precision (1st half) | recall (1st half) | precision (2nd half) | recall (2nd half) |",
        "|---|---|---|---|---|",
    ]
    for threshold, first in result["selection_half"].items():
        second = result["evaluation_half"][threshold]
        lines.append(
            f"| {threshold} | {first['precision']:.4f} | {first['recall']:.4f} | "
            f"{second['precision']:.4f} | {second['recall']:.4f} |"
        )
    recall_by_kind = result["recall_by_variant_at_chosen"]
    lines += [
        "",
        "Share of copies joined to their photo's group at the chosen threshold (both halves): "
        + ", ".join(f"{kind} {share:.3f}" for kind, share in recall_by_kind.items()),
        "",
        "## Speed",
        "",
        f"{result['speed']['items']:,} synthetic unit vectors ({result['speed']['dim']}-d, 200 clusters at "
        "about 0.5 cosine within a cluster, plus 2-3 copies at about 0.995 of 5% of them), index "
        f"`{result['speed']['index']}` {result['speed']['search_params']} "
        f"(built in {result['speed']['build_s']} s, not counted): all groups at threshold "
        f"{DEFAULT_THRESHOLD} in **{result['speed']['find_duplicates_s']} s** "
        f"({result['speed']['groups']} groups, {result['speed']['grouped_items']} items).",
        "",
    ]
    path.write_text("\n".join(lines))


def recall_by_variant(data: dict, threshold: float, work: Path) -> dict[str, float]:
    """For each kind of copy, the share joined to the group of the photo it was made from."""
    originals, copies, copy_source = data["originals"], data["copies"], data["copy_source"]
    vectors = np.concatenate([originals, copies])
    index = GalleryIndex.create(work, dim=vectors.shape[1], model_fingerprint="bench", gallery_root=None)
    ids = np.array(index.add(vectors, [(f"{i}.jpg", None, str(i)) for i in range(len(vectors))]))
    index.save()
    group_of = {int(i): g for g, group in enumerate(find_duplicates(index, threshold)) for i in group.ids}
    index.close()
    joined: dict[str, list[bool]] = {kind: [] for kind in VARIANTS}
    for position in range(len(copies)):
        copy_group = group_of.get(int(ids[len(originals) + position]))
        photo_group = group_of.get(int(ids[copy_source[position]]))
        joined[VARIANTS[position % len(VARIANTS)]].append(
            copy_group is not None and copy_group == photo_group
        )
    return {kind: float(np.mean(values)) for kind, values in joined.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="Cars196 folder with labels.csv")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sources", type=int, default=400, help="photos to make copies of")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed-items", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache/dmlsearch/bench/duplicates_embeddings.npz"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "duplicates")
    parser.add_argument("--speed-only", action="store_true", help="rerun the speed part, keep the rest")
    args = parser.parse_args()
    if args.speed_only:
        result = json.loads(args.out.with_suffix(".json").read_text())
        with tempfile.TemporaryDirectory() as work:
            result["speed"] = speed(result["speed"]["dim"], args.speed_items, args.seed, Path(work))
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        write_markdown(result, args.out.with_suffix(".md"))
        print(result["speed"])
        return

    embedder = Embedder(args.model, threads=args.threads)
    data = embed_dataset(args.data, embedder, args.sources, args.seed, args.cache)
    originals, copies, copy_source = data["originals"], data["copies"], data["copy_source"]
    first_half = set(data["sampled"][: args.sources // 2].tolist())
    in_first = np.array([s in first_half for s in copy_source])
    with tempfile.TemporaryDirectory() as work:
        selection = pair_quality(originals, copies[in_first], copy_source[in_first], Path(work) / "a")
        evaluation = pair_quality(originals, copies[~in_first], copy_source[~in_first], Path(work) / "b")
        chosen = choose_threshold(selection)
        by_kind = recall_by_variant(data, float(chosen), Path(work) / "c")
        speed_result = speed(originals.shape[1], args.speed_items, args.seed, Path(work) / "speed")
    result = {
        "command": "python bench/duplicates.py " + " ".join(sys.argv[1:]),
        "photos": len(originals),
        "sources": args.sources,
        "variants": list(VARIANTS),
        "chosen_threshold": chosen,
        "default_threshold": DEFAULT_THRESHOLD,
        "selection_half": selection,
        "evaluation_half": evaluation,
        "recall_by_variant_at_chosen": by_kind,
        "speed": speed_result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    write_markdown(result, args.out.with_suffix(".md"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
