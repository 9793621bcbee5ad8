"""Does JPEG draft decoding (libjpeg's reduced-size DCT) change retrieval? Recall@K, full vs draft decoding.

    python bench/jpeg_draft.py --data ../shared/data/cars196/images [--classes 98] [--size 1600]

Real queries are phone photos, not 224-pixel crops. Each Cars196 test image (the DML protocol's unseen
classes) is upscaled to ``--size`` pixels on a side and re-encoded as a JPEG, like a photo straight off a
phone. The same bytes are then decoded twice: in full, and with ``draft`` (what the server does), and both
sets are embedded with the same model. Recall@1/2/4/8 of the two sets, how often each image's nearest
neighbour agrees, the cosine between the two embeddings of each image, and the time per image to decode
and preprocess (resize, crop, normalise) are printed (and written with ``--json``), all from one run.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from engine.embedder import Embedder
from engine.images import decode_image
from training.data import load_labelled_images, split_classes
from training.features import backbone_model
from training.metrics import nearest_neighbours, retrieval_metrics


def phone_photo(path: Path, size: int, quality: int) -> bytes:
    """The image upscaled to ``size`` x ``size`` and saved as a camera would (JPEG, 4:2:0)."""
    image = Image.open(path).convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def timed_decode(embedder: Embedder, data: bytes, draft_size: int | None) -> tuple[np.ndarray, int, float]:
    """The model input of ``data``, the decoded short side, and the milliseconds of decode + preprocess."""
    started = time.perf_counter()
    image = decode_image(data, draft_size=draft_size)
    tensor = embedder.preprocess([image])
    return tensor, min(image.size), (time.perf_counter() - started) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="ImageFolder directory or labels CSV")
    parser.add_argument("--model", type=Path, help="model.onnx (default: the pretrained backbone)")
    parser.add_argument("--classes", type=int, default=98, help="use the first N test classes")
    parser.add_argument("--size", type=int, default=1600, help="side of the upscaled 'phone photo'")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
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
    draft_size = embedder.card.preprocessing.resize_size
    full_vectors, draft_vectors, kept = [], [], []
    full_ms, draft_ms, draft_sides = [], [], []
    for start in tqdm(range(0, len(files), args.batch_size), desc="phone photos", unit="batch"):
        full_batch, draft_batch = [], []
        for row in range(start, min(start + args.batch_size, len(files))):
            try:
                photo = phone_photo(files[row], args.size, args.quality)
            except OSError as err:  # the data set's one truncated JPEG, for example
                tqdm.write(f"skipped {files[row]}: {err}")
                continue
            full, _, full_time = timed_decode(embedder, photo, None)
            draft, draft_side, draft_time = timed_decode(embedder, photo, draft_size)
            full_batch.append(full)
            draft_batch.append(draft)
            full_ms.append(full_time)
            draft_ms.append(draft_time)
            draft_sides.append(draft_side)
            kept.append(row)
        if full_batch:
            full_vectors.append(embedder.embed_tensor(np.concatenate(full_batch)))
            draft_vectors.append(embedder.embed_tensor(np.concatenate(draft_batch)))
    full_vectors, draft_vectors = np.concatenate(full_vectors), np.concatenate(draft_vectors)
    labels = labels[kept]

    full_metrics = retrieval_metrics(full_vectors, labels)
    draft_metrics = retrieval_metrics(draft_vectors, labels)
    agreement = float((nearest_neighbours(full_vectors, 1) == nearest_neighbours(draft_vectors, 1)).mean())
    cosines = np.sum(full_vectors * draft_vectors, axis=1)
    result = {
        "model": str(args.model or "pretrained efficientnet_lite0"),
        "fingerprint": embedder.fingerprint,
        "images": len(kept),
        "classes": len(chosen_classes),
        "photo_size": f"{args.size}x{args.size} JPEG q{args.quality}",
        "draft_decoded_short_side": int(np.median(draft_sides)),
        "full": {name: round(100 * value, 2) for name, value in full_metrics.items()},
        "draft": {name: round(100 * value, 2) for name, value in draft_metrics.items()},
        "top1_neighbour_agreement_pct": round(100 * agreement, 2),
        "embedding_cosine_full_vs_draft": {
            "mean": round(float(cosines.mean()), 5),
            "min": round(float(cosines.min()), 5),
        },
        "decode_and_preprocess_ms_median": {
            "full": round(float(np.median(full_ms)), 2),
            "draft": round(float(np.median(draft_ms)), 2),
        },
        "decode_and_preprocess_speedup": round(float(np.median(full_ms) / np.median(draft_ms)), 2),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
