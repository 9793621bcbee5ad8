"""Does JPEG draft decoding (libjpeg's reduced-size DCT) change retrieval? Recall@K, full vs draft decoding.

    python bench/jpeg_draft.py --data CARS196/images [--classes 98] [--size 1600]
                               [--draft-margins 1,2]

Real queries are phone photos, not 224-pixel crops. Each Cars196 test image (the DML protocol's unseen
classes) is upscaled to ``--size`` pixels on a side and re-encoded as a JPEG, like a photo straight off a
phone. The same bytes are then decoded in full and with ``draft`` keeping each requested margin over the
model's resize size (``engine.decode.images.DRAFT_MARGIN`` is what the server and the indexer use), and every
decoding is embedded with the same model. For each: Recall@1/2/4/8 and
MAP@R, the time per image to decode and preprocess (resize, crop, normalise), how often each image's
nearest neighbour agrees with full decoding, the cosine between its embedding and the full one, and a paired
sign test on the queries that one decoding gets right at rank 1 and the other wrong. All from one run,
printed and written with ``--json``.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from lib.options import bench_parser, data_option, model_option, threads_option
from PIL import Image
from scipy.stats import binomtest
from tqdm import tqdm

from engine.decode.images import DRAFT_MARGIN, decode_image
from engine.model.embedder import Embedder
from training.data import load_labelled_images, split_classes
from training.features import backbone_model
from training.metrics import nearest_neighbours, retrieval_metrics


def phone_photo(path: Path, size: int, quality: int) -> bytes:
    """The image upscaled to ``size`` x ``size`` and saved as a camera would (JPEG, 4:2:0)."""
    image = Image.open(path).convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def timed_decode(embedder: Embedder, data: bytes, margin: int | None) -> tuple[np.ndarray, int, float]:
    """The model input of ``data`` decoded in full (``margin`` None) or in draft mode, the decoded short
    side, and the milliseconds of decode + preprocess."""
    started = time.perf_counter()
    if margin is None:
        image = decode_image(data)
    else:
        image = decode_image(data, draft_size=embedder.card.preprocessing.resize_size, draft_margin=margin)
    tensor = embedder.preprocess([image])
    return tensor, min(image.size), (time.perf_counter() - started) * 1000.0


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("ImageFolder directory or labels CSV"),
        model_option(),
        threads_option(0),
    )
    parser.add_argument("--classes", type=int, default=98, help="use the first N test classes")
    parser.add_argument("--size", type=int, default=1600, help="side of the upscaled 'phone photo'")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--draft-margins",
        type=lambda text: [int(margin) for margin in text.split(",")],
        default=[1, DRAFT_MARGIN],
        help="comma-separated margins over the resize size to compare (default: 1 and the served one)",
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()

    data = load_labelled_images(args.data)
    test = split_classes(data).test
    chosen_classes = np.unique(data.labels[test])[: args.classes]
    indices = test[np.isin(data.labels[test], chosen_classes)]
    files, labels = data.files(indices), data.labels[indices]

    with tempfile.TemporaryDirectory() as workdir:
        model = args.model or backbone_model(Path(workdir), "efficientnet_lite0")
        embedder = Embedder(model, threads=args.threads)
    decoders = {"full": None, **{f"draft_x{margin}": margin for margin in args.draft_margins}}
    vectors: dict[str, list[np.ndarray]] = {name: [] for name in decoders}
    milliseconds: dict[str, list[float]] = {name: [] for name in decoders}
    sides: dict[str, list[int]] = {name: [] for name in decoders}
    kept = []
    for start in tqdm(range(0, len(files), args.batch_size), desc="phone photos", unit="batch"):
        tensors: dict[str, list[np.ndarray]] = {name: [] for name in decoders}
        for row in range(start, min(start + args.batch_size, len(files))):
            try:
                photo = phone_photo(files[row], args.size, args.quality)
            except OSError as err:  # the data set's one truncated JPEG, for example
                tqdm.write(f"skipped {files[row]}: {err}")
                continue
            for name, margin in decoders.items():
                tensor, side, elapsed = timed_decode(embedder, photo, margin)
                tensors[name].append(tensor)
                sides[name].append(side)
                milliseconds[name].append(elapsed)
            kept.append(row)
        for name, batch in tensors.items():
            if batch:
                vectors[name].append(embedder.embed_tensor(np.concatenate(batch)))
    embeddings = {name: np.concatenate(chunks) for name, chunks in vectors.items()}
    labels = labels[kept]

    full = embeddings["full"]
    full_correct = labels[nearest_neighbours(full, 1)[:, 0]] == labels
    results = {}
    for name, vecs in embeddings.items():
        entry = {
            "decoded_short_side_median": int(np.median(sides[name])),
            "decode_and_preprocess_ms_median": round(float(np.median(milliseconds[name])), 2),
            **{metric: round(100 * value, 2) for metric, value in retrieval_metrics(vecs, labels).items()},
        }
        if name != "full":
            correct = labels[nearest_neighbours(vecs, 1)[:, 0]] == labels
            only_full, only_draft = int((full_correct & ~correct).sum()), int((correct & ~full_correct).sum())
            cosines = np.sum(full * vecs, axis=1)
            entry |= {
                "speedup_vs_full": round(
                    float(np.median(milliseconds["full"]) / np.median(milliseconds[name])), 2
                ),
                "top1_neighbour_agreement_pct": round(
                    100 * float((nearest_neighbours(full, 1) == nearest_neighbours(vecs, 1)).mean()), 2
                ),
                "embedding_cosine_to_full": {
                    "mean": round(float(cosines.mean()), 5),
                    "min": round(float(cosines.min()), 5),
                },
                # Paired test of Recall@1: queries right with one decoding and wrong with the other.
                "recall@1_discordant": {"only_full_right": only_full, "only_draft_right": only_draft},
                "recall@1_sign_test_p": round(
                    float(binomtest(only_full, only_full + only_draft).pvalue)
                    if only_full + only_draft
                    else 1.0,
                    4,
                ),
            }
        results[name] = entry
    result = {
        "model": str(args.model or "pretrained efficientnet_lite0"),
        "fingerprint": embedder.fingerprint,
        "images": len(kept),
        "classes": len(chosen_classes),
        "photo_size": f"{args.size}x{args.size} JPEG q{args.quality}",
        "decodings": results,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
