"""Which peak points at the pasted object? The variants tried for issue 23's pointing goal, scored on the
pairs of ``explain_pointing.py`` (same draw, same rule: the peak's centre inside the object's box).

    python bench/explain_variants.py [--model MODEL] [--pairs 240] [--seed 0] [--any-photos]
                                     [--objects FOLDER] [--out bench/results/explain_variants.json]

Every variant starts from what the served model exports (the embeddings and each position's contribution
``c_p``, through onnxruntime). Exact ones pick a region by a share of the served cosine; the others are
scored to see what a non-exact choice would gain:

- ``position``, ``window2``, ``window3``: the heatmap's best single position, 2 x 2 or 3 x 3 window (exact);
- ``smoothed``: the heatmap's peak after a Gaussian blur (sigma one position; not a share any more);
- ``contrast``: the heatmap against ``e_other - mean`` instead of ``e_other``, the mean being all the run's
  embeddings (a share of ``cos - <e, mean>``; the mean holds these very backgrounds, so it is optimistic);
- ``largest1``, ``largest2``, ``largest3``: the pair of single positions, 2 x 2 or 3 x 3 windows, one in
  each image, that carry the largest share of the cosine between them (exact);
- ``specific1``, ``specific2``, ``specific3``: the same pairs chosen after removing what each carries on
  average with the other image's windows (``matched3`` was served before);
- ``matched1``, ``matched2``, ``matched3``: the pairs whose positions point most alike (the cosine of their
  contributions), centred the same way (``engine.serve.explain.matched_windows``; ``matched3`` is served).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from lib.options import bench_parser, model_option, out_option, seed_option
from lib.pasted_pairs import SIDE, centre, explainable_bundle, heatmap_peak, inside, pasted_pairs
from scipy.ndimage import gaussian_filter

from engine.serve.explain import Peak, matched_windows, window_sums
from foundation.atomic import atomic_write_text
from foundation.defaults import BACKBONE
from training.features import backbone_model


def largest_pair(query: np.ndarray, item: np.ndarray, size: int) -> tuple[Peak, Peak]:
    shares = np.einsum("ijd,kld->ijkl", window_sums(query, size), window_sums(item, size))
    top_q, left_q, top_i, left_i = np.unravel_index(int(np.argmax(shares)), shares.shape)
    return Peak(int(top_q), int(left_q), size, 0.0), Peak(int(top_i), int(left_i), size, 0.0)


def specific_pair(query: np.ndarray, item: np.ndarray, size: int) -> tuple[Peak, Peak]:
    shares = np.einsum("ijd,kld->ijkl", window_sums(query, size), window_sums(item, size))
    specific = shares - shares.mean(axis=(2, 3), keepdims=True) - shares.mean(axis=(0, 1), keepdims=True)
    top_q, left_q, top_i, left_i = np.unravel_index(int(np.argmax(specific)), shares.shape)
    return Peak(int(top_q), int(left_q), size, 0.0), Peak(int(top_i), int(left_i), size, 0.0)


def run(model: Path, pairs: int, seed: int, any_photos: bool, objects: Path | None) -> dict:
    bundle = explainable_bundle(model)
    draws = []  # (boxes, contributions, embeddings): the contrast variant needs the run's mean first
    for images, boxes in pasted_pairs(pairs, seed, any_photos, objects):
        embeddings, maps = bundle.embedder.embed_with_maps(bundle.embedder.preprocess(images))
        draws.append((boxes, bundle.explainer.split(maps)[0], embeddings))
    mean = np.mean([embeddings for _, _, embeddings in draws], axis=(0, 1))
    hits: dict[str, list[tuple[bool, bool]]] = {}
    for boxes, contributions, embeddings in draws:
        grids = np.einsum("nhwd,nd->nhw", contributions, embeddings[::-1])
        contrast = np.einsum("nhwd,nd->nhw", contributions, embeddings[::-1] - mean)
        peaks = {
            "position": [heatmap_peak(grid, 1) for grid in grids],
            "window2": [heatmap_peak(grid, 2) for grid in grids],
            "window3": [heatmap_peak(grid, 3) for grid in grids],
            "smoothed": [heatmap_peak(gaussian_filter(grid, 1.0, mode="nearest"), 1) for grid in grids],
            "contrast": [heatmap_peak(grid, 1) for grid in contrast],
            **{f"largest{size}": largest_pair(*contributions, size) for size in (1, 2, 3)},
            **{f"specific{size}": specific_pair(*contributions, size) for size in (1, 2, 3)},
            **{f"matched{size}": matched_windows(*contributions, size) for size in (1, 2, 3)},
        }
        for kind, pair in peaks.items():
            grid = grids[0].shape
            hits.setdefault(kind, []).append(
                tuple(inside(box, centre(peak, grid)) for peak, box in zip(pair, boxes, strict=True))
            )
    return {
        "model": str(model),
        "pairs": pairs,
        "seed": seed,
        "scenes": "any three photos" if any_photos else "three different scenes",
        "objects": str(objects) if objects else "demo photos",
        "side": SIDE,
        "peak_in_box": {
            kind: {
                "query": float(np.mean(h[:, 0])),
                "item": float(np.mean(h[:, 1])),
                "both": float(h.all(1).mean()),
            }
            for kind, h in ((kind, np.array(values)) for kind, values in hits.items())
        },
    }


def main() -> None:
    parser = bench_parser(__doc__, model_option(), seed_option(), out_option())
    parser.add_argument("--pairs", type=int, default=240)
    parser.add_argument("--any-photos", action="store_true", help="explain_pointing.py's first protocol")
    parser.add_argument("--objects", type=Path, help="take the objects from the images (*.jpg) under it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or backbone_model(Path(folder), BACKBONE)
        result = run(model, args.pairs, args.seed, args.any_photos, args.objects)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        atomic_write_text(args.out.with_suffix(".json"), text + "\n")


if __name__ == "__main__":
    main()
