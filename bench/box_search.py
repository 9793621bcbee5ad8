"""Search by a region: a photo pasted into a large unrelated picture, found with and without a box on it.

    python bench/box_search.py --data CARS196/images [--model model.onnx] [--count 400]

Each of ``--count`` gallery photos (Cars196 test classes, a seeded sample; Cars196 ships no bounding boxes
here, so the pasted object is the whole car photo) is pasted at a random place and size (15-40% of the
width) into one of the demo gallery's non-vehicle source photos (``engine.gallery.demo``), upscaled to a
1600-px long side, and the scene is saved as a JPEG (quality 90), as a camera would. Each scene is then a
query three ways, through the decode task the server runs (``engine.decode.model_input.decode_uploads``, JPEG
draft on, as served) and the served model:
- whole: the scene, no box;
- box: the scene with ``box`` = the pasted rectangle in pixels (cropped after decoding, before the resize);
- hand crop: the pasted rectangle cut from the fully decoded scene beforehand and sent alone (lossless PNG).
Reported per way: source Recall@1 (the pasted photo itself ranks first among the ``--count`` gallery
photos), class Recall@1 (the top other photo is the same car model; the source left out), and the mean
rank of the source. Without ``--model`` the pretrained backbone is exported first, the model `make demo`
serves.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from lib.options import bench_parser, data_option, model_option, out_option, seed_option, threads_option
from PIL import Image
from tqdm import tqdm

from engine.decode.images import decode_image
from engine.decode.model_input import PixelBudget, decode_uploads
from engine.decode.regions import Box
from engine.gallery.demo import PHOTOS
from engine.model.embedder import Embedder
from training.data import load_labelled_images, split_classes
from training.features import backbone_model

BACKGROUND_SIDE = 1600
OBJECT_WIDTH = (0.15, 0.40)  # of the background's width
JPEG_QUALITY = 90
UNRELATED = [photo for photo in PHOTOS if photo.label != "motorcycle"]  # vehicles would be related
WAYS = ("whole", "box", "hand_crop")


def backgrounds() -> list[Image.Image]:
    """The demo gallery's source photos (no vehicles), upscaled to a long side of BACKGROUND_SIDE."""
    found = []
    for photo in UNRELATED:
        image = Image.fromarray(photo.load()).convert("RGB")
        scale = BACKGROUND_SIDE / max(image.size)
        found.append(image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC))
    return found


def scene(photo: Image.Image, background: Image.Image, rng: np.random.Generator) -> tuple[bytes, Box]:
    """``photo`` pasted into a copy of ``background`` (JPEG bytes) and its box there, in pixels."""
    width = round(rng.uniform(*OBJECT_WIDTH) * background.width)
    height = min(round(photo.height * width / photo.width), background.height)
    width = round(photo.width * height / photo.height)
    x0 = int(rng.integers(0, background.width - width + 1))
    y0 = int(rng.integers(0, background.height - height + 1))
    canvas = background.copy()
    canvas.paste(photo.resize((width, height), Image.BICUBIC), (x0, y0))
    buffer = io.BytesIO()
    canvas.save(buffer, "JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue(), Box(x0, y0, x0 + width, y0 + height)


def hand_crop(data: bytes, box: Box) -> bytes:
    """What a person would send: the region cut from the decoded scene, saved losslessly."""
    image = decode_image(data)
    buffer = io.BytesIO()
    image.crop((round(box.x0), round(box.y0), round(box.x1), round(box.y1))).save(buffer, "PNG")
    return buffer.getvalue()


def embed(embedder: Embedder, budget: PixelBudget, data: bytes, box: Box | None = None) -> np.ndarray:
    decoded = decode_uploads([data], budget, embedder.card.preprocessing, boxes=[box])
    return embedder.embed_tensor(decoded.tensor)[0]


def recalls(queries: np.ndarray, gallery: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Source R@1, class R@1 (source left out) and the source's mean rank, for query i of gallery item i."""
    scores = queries @ gallery.T
    count = len(gallery)
    source = np.arange(count)
    source_scores = scores[source, source]
    ranks = 1 + (scores > source_scores[:, None]).sum(axis=1)
    others = scores.copy()
    others[source, source] = -np.inf
    class_hit = labels[others.argmax(axis=1)] == labels
    return {
        "source_recall@1": round(100 * float(np.mean(ranks == 1)), 2),
        "class_recall@1": round(100 * float(np.mean(class_hit)), 2),
        "source_mean_rank": round(float(ranks.mean()), 2),
    }


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("Cars196 images/ (one folder per class)"),
        model_option(),
        seed_option(),
        threads_option(0),
        out_option(Path("bench/results/box_search")),
    )
    parser.add_argument("--count", type=int, default=400)
    args = parser.parse_args()

    data = load_labelled_images(args.data)
    rng = np.random.default_rng(args.seed)
    test = split_classes(data)["test"]
    chosen = np.sort(rng.choice(test, size=min(args.count, len(test)), replace=False))
    files, labels = data.files(chosen), data.labels[chosen]
    scenes_background = backgrounds()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        model = args.model or backbone_model(Path(workdir), "efficientnet_lite0")
        embedder = Embedder(model, threads=args.threads)
        budget = PixelBudget(draft_size=embedder.card.preprocessing.resize_size)  # as served (JPEG draft on)
        gallery = np.stack(
            [embed(embedder, budget, path.read_bytes()) for path in tqdm(files, desc="gallery")]
        )
        queries: dict[str, list[np.ndarray]] = {way: [] for way in WAYS}
        for path in tqdm(files, desc="scenes"):
            background = scenes_background[int(rng.integers(len(scenes_background)))]
            data_bytes, box = scene(decode_image(path.read_bytes()), background, rng)
            queries["whole"].append(embed(embedder, budget, data_bytes))
            queries["box"].append(embed(embedder, budget, data_bytes, box))
            queries["hand_crop"].append(embed(embedder, budget, hand_crop(data_bytes, box)))
    results = {way: recalls(np.stack(vectors), gallery, labels) for way, vectors in queries.items()}
    box_vs_crop = np.einsum("ij,ij->i", np.stack(queries["box"]), np.stack(queries["hand_crop"]))
    report = {
        "command": "python bench/box_search.py --data " + str(args.data) + f" --count {args.count} "
        f"--seed {args.seed}" + (f" --model {args.model}" if args.model else ""),
        "model": str(args.model or "pretrained efficientnet_lite0 (the model `make demo` serves)"),
        "fingerprint": embedder.fingerprint,
        "gallery_photos": len(files),
        "classes": len(np.unique(labels)),
        "backgrounds": [photo.label for photo in UNRELATED],
        "scene": f"{BACKGROUND_SIDE}-px long side, object {OBJECT_WIDTH[0]:.0%}-{OBJECT_WIDTH[1]:.0%} of the "
        f"width, JPEG q{JPEG_QUALITY}",
        "results": results,
        "box_vs_hand_crop_cosine": {
            "mean": round(float(box_vs_crop.mean()), 5),
            "min": round(float(box_vs_crop.min()), 5),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report, indent=2))


def markdown(report: dict) -> str:
    rows = "\n".join(
        f"| {way} | {values['source_recall@1']:.2f} | {values['class_recall@1']:.2f} | "
        f"{values['source_mean_rank']:.2f} |"
        for way, values in report["results"].items()
    )
    cosine = report["box_vs_hand_crop_cosine"]
    return (
        f"# Search by a region (`{report['command']}`)\n\n"
        f"{report['gallery_photos']} Cars196 test-class photos ({report['classes']} classes) pasted into "
        f"unrelated photos ({', '.join(report['backgrounds'])}; {report['scene']}); "
        f"model: {report['model']}.\n\n"
        "| query | source Recall@1 (%) | class Recall@1 (%) | source mean rank |\n|---|---:|---:|---:|\n"
        f"{rows}\n\n"
        "Box vs hand crop, cosine between the two query embeddings: "
        f"mean {cosine['mean']}, min {cosine['min']}.\n"
    )


if __name__ == "__main__":
    main()
