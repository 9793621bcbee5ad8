"""The near-duplicate benches' data (bench/duplicate_tiers.py, bench/crop_alignment.py, bench/duplicates.py):
the copies made of each photo and their true tiers, the two halves' indexes, the pairs found scored against
the truth, and a synthetic index of any size for the speed runs."""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageOps
from tqdm import tqdm

from engine.decode.images import decode_image
from engine.duplicates.signature import perceptual_signature
from engine.duplicates.signature_layout import THUMBNAIL_SIDE, VIEWS
from engine.duplicates.tiers import (
    Tier,
)
from engine.gallery.demo import PHOTOS
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex
from index.protocol import Entry

EDITS = (
    "reencoded",
    "resized",
    "cropped90",
    "cropped88_offset",
    "cropped94_corner",
    "cropped82_offset",
    "cropped85_reencoded",
    "rotated3",
    "rotated2_cropped",
    "rotated90",
    "mirrored",
    "colour",
    "watermark",
)
KINDS = ("original", "lossless", *EDITS, "take")
NO_TIER = len(Tier)
PRECISION_GOAL, FALSE_IMAGE_GOAL = 0.98, 0.01
# Shares of the source image's sides (left, top, right, bottom): the photo, and its second take's window.
PHOTO_WINDOW = (0.075, 0.075, 0.925, 0.925)
TAKE_WINDOW = (0.15, 0.125, 1.0, 0.975)
TAKE_TURN = 0.03  # the take's left edge this share of the source's height shorter at each end


def make_copy(image: Image.Image, kind: str) -> Image.Image:
    w, h = image.size
    if kind == "reencoded":
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=50)
        return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    if kind == "resized":
        return image.resize((max(1, w // 2), max(1, h // 2)), Image.Resampling.LANCZOS)
    if kind == "cropped90":
        return image.crop((round(w * 0.05), round(h * 0.05), round(w * 0.95), round(h * 0.95)))
    if kind == "cropped88_offset":
        return image.crop((round(w * 0.12), round(h * 0.02), w, round(h * 0.90)))
    if kind == "cropped94_corner":  # 6% off the left and the top
        return image.crop((round(w * 0.06), round(h * 0.06), w, h))
    if kind == "cropped82_offset":  # off-centre the other way, tighter
        return image.crop((round(w * 0.03), round(h * 0.12), round(w * 0.85), round(h * 0.94)))
    if kind == "cropped85_reencoded":
        return make_copy(image.crop((round(w * 0.10), 0, round(w * 0.95), round(h * 0.85))), "reencoded")
    if kind == "rotated2_cropped":  # turned the other way, then cropped off-centre
        turned = image.rotate(-2, resample=Image.Resampling.BICUBIC)
        return turned.crop((round(w * 0.08), round(h * 0.04), round(w * 0.98), round(h * 0.90)))
    if kind == "rotated3":
        turned = image.rotate(3, resample=Image.Resampling.BICUBIC)
        return turned.crop((round(w * 0.05), round(h * 0.05), round(w * 0.95), round(h * 0.95)))
    if kind == "rotated90":
        return image.transpose(Image.Transpose.ROTATE_90)
    if kind == "mirrored":
        return ImageOps.mirror(image)
    if kind == "colour":
        image = ImageEnhance.Color(image).enhance(1.3)
        return ImageEnhance.Contrast(ImageEnhance.Brightness(image).enhance(1.1)).enhance(0.9)
    if kind == "watermark":
        marked = image.convert("RGBA")
        layer = Image.new("RGBA", marked.size, (0, 0, 0, 0))
        draw = ImageDraw.Draw(layer)
        draw.rectangle((0, round(h * 0.85), w, h), fill=(255, 255, 255, 110))
        draw.text((round(w * 0.05), round(h * 0.88)), "(c) dmlsearch bench 2026", fill=(0, 0, 0, 200))
        draw.rectangle(
            (round(w * 0.85), round(h * 0.03), round(w * 0.97), round(h * 0.15)), fill=(200, 0, 0, 140)
        )
        return Image.alpha_composite(marked, layer).convert("RGB")
    raise ValueError(kind)


def photo_window(source: Image.Image) -> Image.Image:
    w, h = source.size
    left, top, right, bottom = PHOTO_WINDOW
    return source.crop((round(w * left), round(h * top), round(w * right), round(h * bottom)))


def second_take(source: Image.Image) -> Image.Image:
    """The scene of ``photo_window(source)`` again after a camera move: ``TAKE_WINDOW`` of the source seen
    through a homography (the camera turned about its vertical axis), 5% brighter."""
    w, h = source.size
    left, top, right, bottom = (share * side for share, side in zip(TAKE_WINDOW, (w, h, w, h), strict=True))
    size = (round(right - left), round(bottom - top))
    corners = np.array([(0, 0), (size[0], 0), (size[0], size[1]), (0, size[1])], dtype=np.float64)
    inset = TAKE_TURN * h
    seen = np.array([(left, top + inset), (right, top), (right, bottom), (left, bottom - inset)])
    # PIL's PERSPECTIVE maps each output pixel (x, y) to the source point ((c0 x + c1 y + c2) / (c6 x + c7 y
    # + 1), (c3 x + c4 y + c5) / (c6 x + c7 y + 1)): two equations linear in c0..c7 per corner.
    equations = [
        row
        for (x, y), (u, v) in zip(corners, seen, strict=True)
        for row in ((x, y, 1, 0, 0, 0, -x * u, -y * u), (0, 0, 0, x, y, 1, -x * v, -y * v))
    ]
    coefficients = np.linalg.solve(np.array(equations, dtype=np.float64), seen.ravel())
    turned = source.transform(
        size, Image.Transform.PERSPECTIVE, tuple(coefficients), Image.Resampling.BICUBIC
    )
    return ImageEnhance.Brightness(turned).enhance(1.05)


def pixel_digest(image: Image.Image) -> str:
    return hashlib.sha256(f"{image.width}x{image.height}".encode() + image.tobytes()).hexdigest()


def photo_list(data: Path, classes: int, per_class: int, seed: int) -> list[tuple[str, int]]:
    """``(path, class)`` of ``per_class`` test photos of each of ``classes`` car models."""
    by_class: dict[int, list[str]] = {}
    with (data / "labels.csv").open() as handle:
        for row in csv.DictReader(handle):
            if row["dml_split"] == "test":
                by_class.setdefault(int(row["class_id"]), []).append(row["path"])
    rng = np.random.default_rng(seed)
    chosen = rng.choice(sorted(by_class), size=classes, replace=False)
    return [
        (path, int(label))
        for label in sorted(chosen.tolist())
        for path in rng.choice(by_class[label], size=min(per_class, len(by_class[label])), replace=False)
    ]


def bench_images(args: argparse.Namespace, draft: int) -> Iterator[tuple[Image.Image, dict]]:
    """Every image with its ground truth (source photo, kind, class, half), in the bench's order; photos are
    windows of their source decoded with the JPEG draft for ``draft`` px, their copies and takes made from
    the full decode."""
    photos = photo_list(args.data, args.classes, args.per_class, args.seed)
    labels = sorted({label for _, label in photos})
    half_a = set(labels[: len(labels) // 2])
    rng = np.random.default_rng(args.seed + 1)
    sources = {
        half: set(
            rng.choice(
                [i for i, (_, c) in enumerate(photos) if (c in half_a) == (half == "A")],
                size=args.sources,
                replace=False,
            ).tolist()
        )
        for half in ("A", "B")
    }

    def truth(source: str, kind: str, label: int, half: str) -> dict:
        return {"source": source, "kind": kind, "label": label, "half": half}

    def with_copies(
        full: Image.Image, embedded: Image.Image, source: str, label: int, half: str
    ) -> Iterator[tuple[Image.Image, dict]]:
        """``embedded`` (the photo as indexed) and the copies of the photo in ``full`` (its whole source)."""
        yield embedded, truth(source, "original", label, half)
        yield embedded, truth(source, "lossless", label, half)  # same pixels: as decoded from its PNG
        photo = photo_window(full)
        for kind in EDITS:
            yield make_copy(photo, kind), truth(source, kind, label, half)
        yield second_take(full), truth(source, "take", label, half)

    for position, (path, label) in enumerate(tqdm(photos, desc="photos", unit="img")):
        half = "A" if label in half_a else "B"
        encoded = (args.data / path).read_bytes()
        photo = photo_window(decode_image(encoded, draft_size=draft))
        if position in sources[half]:
            yield from with_copies(decode_image(encoded), photo, path, label, half)
        else:
            yield photo, truth(path, "original", label, half)
    motorcycle = False
    for number, demo in enumerate(PHOTOS):
        full = Image.fromarray(demo.load()).convert("RGB")
        photo = photo_window(full)
        # The motorcycle's two views are one scene: the right view is the left view's second take.
        source = "demo:motorcycle" if demo.label == "motorcycle" else f"demo:{demo.label}"
        if source == "demo:motorcycle" and motorcycle:
            yield photo, truth(source, "take", -1, "B")
        else:
            motorcycle = motorcycle or source == "demo:motorcycle"
            yield from with_copies(full, photo, source, -1 - number, "B")


def resign(args: argparse.Namespace, data: dict, draft: int) -> None:
    """The signatures of cached images computed again (engine/duplicates/signature.py changed; the vectors
    kept)."""
    for number, (image, record) in enumerate(bench_images(args, draft)):
        cached = data["records"][number]
        if any(cached[key] != value for key, value in record.items()):
            raise SystemExit(f"image {number} is not the cache's: {record} against {cached}")
        cached["signature"] = perceptual_signature(image).hex()


def build_items(args: argparse.Namespace, embedder: Embedder) -> dict:
    """Every image's vector, signature, pixel digest and ground truth (source photo, kind, class, half)."""
    records: list[dict] = []
    images: list[Image.Image] = []
    vectors = []
    for image, record in bench_images(args, embedder.card.preprocessing.resize_size):
        records.append(
            record | {"signature": perceptual_signature(image).hex(), "digest": pixel_digest(image)}
        )
        images.append(image)
        if len(images) >= 32:
            vectors.append(embedder.embed(images))
            images.clear()
    if images:
        vectors.append(embedder.embed(images))
    return {"records": records, "vectors": np.concatenate(vectors)}


def true_tiers(records: list[dict], firsts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Each pair's true tier (``NO_TIER`` for images of different photos)."""
    out = np.full(len(firsts), NO_TIER)
    for n, (a, b) in enumerate(zip(firsts.tolist(), seconds.tolist(), strict=True)):
        first, second = records[a], records[b]
        if first["source"] != second["source"]:
            continue
        kinds = {first["kind"], second["kind"]}
        if "take" in kinds:
            out[n] = Tier.SIMILAR
        elif kinds <= {"original", "lossless"}:
            out[n] = Tier.EXACT
        else:
            out[n] = Tier.EDITED
    return out


def all_true_pairs(records: list[dict], members: list[int]) -> np.ndarray:
    """How many true pairs of each tier the images ``members`` hold."""
    by_source: dict[str, list[int]] = {}
    for i in members:
        by_source.setdefault(records[i]["source"], []).append(i)
    counts = np.zeros(NO_TIER, dtype=np.int64)
    for group in by_source.values():
        pairs = np.array([(a, b) for x, a in enumerate(group) for b in group[x + 1 :]], dtype=np.int64)
        if len(pairs):
            counts += np.bincount(true_tiers(records, pairs[:, 0], pairs[:, 1]), minlength=NO_TIER + 1)[
                :NO_TIER
            ]
    return counts


def half_index(data: dict, half: str, work: Path) -> tuple[GalleryIndex, list[int]]:
    """An index of the images of ``half`` (item path = the record number)."""
    members = [i for i, r in enumerate(data["records"]) if r["half"] == half]
    index = GalleryIndex.create(
        work, dim=data["vectors"].shape[1], model_fingerprint="bench", gallery_root=None
    )
    entries = [Entry(str(i), None, f"item{i}") for i in members]
    signatures = [bytes.fromhex(data["records"][i]["signature"]) for i in members]
    index.add(data["vectors"][members], entries, signatures)
    index.save()
    return index, members


def digests_for(data: dict):
    def digests(items):
        return {item.id: data["records"][int(item.path)]["digest"] for item in items}

    return digests


def record_of(index: GalleryIndex, ids: np.ndarray) -> np.ndarray:
    items = index.items.get_many([int(i) for i in np.unique(ids)])
    lookup = {i: int(item.path) for i, item in items.items()}
    return np.array([lookup[int(i)] for i in ids], dtype=np.int64)


def pair_scores(found_tiers: np.ndarray, truth: np.ndarray, true_counts: np.ndarray) -> dict:
    """Per tier: precision (pairs classified that tier that truly are) and recall (true pairs of that tier
    classified so); ``at_most``: the same for 'this tier or stricter'."""
    scores = {}
    for tier in Tier:
        found = found_tiers == tier
        correct = int((found & (truth == tier)).sum())
        wider = found_tiers <= tier
        wider_true = truth <= tier
        scores[tier.label] = {
            "precision": correct / found.sum() if found.sum() else 1.0,
            "recall": correct / true_counts[tier] if true_counts[tier] else 1.0,
            "found_pairs": int(found.sum()),
            "true_pairs": int(true_counts[tier]),
            "at_most_precision": int((wider & wider_true).sum()) / wider.sum() if wider.sum() else 1.0,
            "at_most_recall": int((wider & wider_true).sum()) / true_counts[: tier + 1].sum(),
        }
    return scores


def false_edited_images(records: list[dict], members: list[int], groups) -> tuple[int, int]:
    """Cars196 photos (originals) in a group with another Cars196 photo's image, and how many Cars196
    photos the images ``members`` (those of one half) hold."""
    bad = 0
    for group in groups:
        sources = {records[i]["source"] for i in group}
        if len(sources) > 1:
            bad += sum(
                1
                for i in group
                if records[i]["kind"] == "original" and not records[i]["source"].startswith("demo:")
            )
    photos = [records[i] for i in members]
    return bad, sum(1 for r in photos if r["kind"] == "original" and not r["source"].startswith("demo:"))


def _smooth_thumbnails(rng: np.random.Generator, count: int) -> np.ndarray:
    """Random photo-like greyscale thumbnails (an 8x8 random image scaled up smoothly)."""
    coarse = rng.integers(0, 256, size=(count, 8, 8), dtype=np.uint8)
    return np.array(
        [
            np.asarray(Image.fromarray(c).resize((THUMBNAIL_SIDE,) * 2, Image.Resampling.BICUBIC))
            for c in coarse
        ],
        dtype=np.uint8,
    ).reshape(count, THUMBNAIL_SIDE, THUMBNAIL_SIDE)


def _window(thumbnail: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """An off-centre window of 80-95% of each side, scaled back to a thumbnail: a crop's thumbnail."""
    side = THUMBNAIL_SIDE
    w, h = (round(side * share) for share in rng.uniform(0.8, 0.95, size=2))
    left, top = rng.integers(0, side - w + 1), rng.integers(0, side - h + 1)
    window = Image.fromarray(thumbnail).crop((left, top, left + w, top + h))
    return np.asarray(window.resize((side, side), Image.Resampling.BILINEAR))


def synthetic_index(
    real: np.ndarray, count: int, seed: int, work: Path, *, crops: float = 0.0, siblings: float = 0.0
) -> tuple[GalleryIndex, int, float]:
    """An index of about ``count`` vectors made from ``real`` embeddings (see the module's doc), saved as
    build-index would; also the planted copies and the seconds the save (build and tuning) took.

    ``crops``, ``siblings``: shares of ``count`` planted for the aligned check of the edited tier
    (bench/duplicate_tiers.py): off-centre crops of a photo (about 0.93 cosine to it, a random signature,
    its thumbnail a window of the photo's) and other photos of the same thing (about 0.9 cosine, a random
    signature and thumbnail)."""
    rng = np.random.default_rng(seed)
    dim = real.shape[1]
    planted_aligned = round(count * crops) + round(count * siblings)
    originals = count - count * 5 // 100 * 5 // 2 - planted_aligned  # room for 2-3 copies of 5% of them
    noise = rng.standard_normal((originals, dim)).astype(np.float32)
    # Noise of norm 0.6 around a unit vector: about 0.85 cosine to it, like another photo of that car.
    noise *= 0.6 / np.linalg.norm(noise, axis=1, keepdims=True)
    base = real[rng.integers(len(real), size=originals)] + noise
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    signatures = rng.integers(0, 2**63, size=(originals, VIEWS), dtype=np.int64).view(np.uint64)
    thumbnails = _smooth_thumbnails(rng, originals)
    duplicated = rng.choice(originals, size=count // 20, replace=False)
    copies = np.repeat(duplicated, rng.integers(2, 4, size=len(duplicated)))
    noise = rng.standard_normal((len(copies), dim)).astype(np.float32)
    noisy = base[copies] + 0.25 * noise / np.linalg.norm(noise, axis=1, keepdims=True)  # ~0.97 cosine
    flipped = signatures[copies].copy()
    flipped[:, 0] ^= np.uint64(0b101)  # two bits off the photo's own view
    vector_parts, signature_parts, thumbnail_parts = (
        [base, noisy],
        [signatures, flipped],
        [thumbnails, thumbnails[copies]],
    )
    for share, spread, windows in ((crops, 0.38, True), (siblings, 0.45, False)):  # ~0.93, ~0.9 cosine
        of = rng.choice(originals, size=round(count * share), replace=False)
        noise = rng.standard_normal((len(of), dim)).astype(np.float32)
        vector_parts.append(base[of] + spread * noise / np.linalg.norm(noise, axis=1, keepdims=True))
        signature_parts.append(rng.integers(0, 2**63, size=(len(of), VIEWS), dtype=np.int64).view(np.uint64))
        planted = (
            [_window(thumbnails[i], rng) for i in of] if windows else list(_smooth_thumbnails(rng, len(of)))
        )
        thumbnail_parts.append(np.array(planted, dtype=np.uint8).reshape(-1, THUMBNAIL_SIDE, THUMBNAIL_SIDE))
    vectors = np.concatenate(vector_parts)  # about count items
    all_signatures = np.concatenate(signature_parts)
    all_thumbnails = np.concatenate(thumbnail_parts)
    index = GalleryIndex.create(work, dim=dim, model_fingerprint="bench", gallery_root=None)
    for start in range(0, len(vectors), 20_000):
        chunk = slice(start, start + 20_000)
        entries = [Entry(f"{start + i}", None, f"{start + i}") for i in range(len(vectors[chunk]))]
        blobs = [
            row.tobytes() + thumbnail.tobytes()
            for row, thumbnail in zip(all_signatures[chunk], all_thumbnails[chunk], strict=True)
        ]
        index.add(vectors[chunk], entries, blobs)
    started = time.perf_counter()
    index.save()  # builds and tunes the index the automatic choice picks
    return index, len(copies) + planted_aligned, time.perf_counter() - started
