"""Does the heatmap point at the right place? One object pasted into two different backgrounds: the peak of
each image's heatmap (``engine.serve.explain``) should fall inside the pasted object's box.

    python bench/explain_pointing.py [--model MODEL] [--pairs 240] [--seed 0] [--any-photos]
                                     [--objects FOLDER] [--out bench/results/explain_pointing.json]

Objects and backgrounds are the demo gallery's source photos (``engine.gallery.demo.PHOTOS``: real photos
shipped in scikit-image and scikit-learn). Per pair: a random square crop of one photo, resized to 56-96
px, is pasted at random places into random 224 x 224 crops of two other photos (the model sees all of a
224-pixel square image). The three photos show three different scenes (labels): the two views of the
stereo motorcycle are one scene, so they are never the two "different" backgrounds, nor an object and its
background. ``--any-photos`` draws three different photos instead (the first runs' protocol, where 3-6%
of pairs had the same scene twice). ``--objects FOLDER`` takes the objects from other photos, none seen
while the peak was chosen: the centre square (30-60% of the short side) of a random image under FOLDER
(e.g. Cars196's images, whose cars fill the centre), pasted into two demo scenes. Three peaks of each
image are scored, each counted inside when its centre lies in the pasted box:

- ``matched``, the served one (``engine.serve.explain.matched_windows``): the 3 x 3 windows of grid positions,
  one in each image, whose pairs of positions point most alike (the cosine of their contributions),
  beyond how alike each is to the other image's positions on average;
- ``window``: the 3 x 3 window of the image's own heatmap whose shares add up to the most;
- ``position``: the single grid position with the largest share.

Baselines: a random peak of each size (the fraction of windows, or positions, whose centre lies in the
box: its exact expectation) and the image centre. Without ``--model`` the pretrained model is exported
first.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from lib.options import bench_parser, model_option, out_option, seed_option
from lib.pasted_pairs import (
    SIDE,
    SIZES,
    centre,
    explainable_bundle,
    heatmap_peak,
    inside,
    pasted_pairs,
    random_peak_in_box,
)

from engine.serve.explain import explain_tensor
from foundation.atomic import atomic_write_text
from foundation.defaults import BACKBONE
from training.features import backbone_model


def run(model: Path, pairs: int, seed: int, any_photos: bool = False, objects: Path | None = None) -> dict:
    bundle = explainable_bundle(model)
    hits = {kind: np.zeros((pairs, 2), bool) for kind in SIZES}
    random_peak = {size: np.zeros((pairs, 2)) for size in set(SIZES.values())}
    at_centre = np.zeros((pairs, 2), bool)
    for pair, (images, boxes) in enumerate(pasted_pairs(pairs, seed, any_photos, objects)):
        _, grids, _, matched = explain_tensor(bundle, bundle.embedder.preprocess(images))
        for side, (grid, box) in enumerate(zip(grids, boxes, strict=True)):
            peaks = {
                "matched": matched[side],
                "window": heatmap_peak(grid, SIZES["window"]),
                "position": heatmap_peak(grid, SIZES["position"]),
            }
            for kind, peak in peaks.items():
                hits[kind][pair, side] = inside(box, centre(peak, grid.shape))
            for size, chance in random_peak.items():
                chance[pair, side] = random_peak_in_box(box, grid, size)
            at_centre[pair, side] = inside(box, (SIDE / 2, SIDE / 2))
    return {
        "model": str(model),
        "pairs": pairs,
        "seed": seed,
        "scenes": "any three photos" if any_photos else "three different scenes",
        "objects": str(objects) if objects else "demo photos",
        "peak_in_box": {
            kind: {"query": hit[:, 0].mean(), "item": hit[:, 1].mean(), "both": hit.all(1).mean()}
            for kind, hit in hits.items()
        },
        "random_peak_in_box": {
            f"{size}x{size}": {"query": chance[:, 0].mean(), "item": chance[:, 1].mean()}
            for size, chance in sorted(random_peak.items())
        },
        "centre_in_box": {"query": at_centre[:, 0].mean(), "item": at_centre[:, 1].mean()},
    }


def main() -> None:
    parser = bench_parser(__doc__, model_option(), seed_option(), out_option())
    parser.add_argument("--pairs", type=int, default=240)
    parser.add_argument("--any-photos", action="store_true", help="the first runs' protocol (see above)")
    parser.add_argument("--objects", type=Path, help="take the objects from the images (*.jpg) under it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or backbone_model(Path(folder), BACKBONE)
        result = run(model, args.pairs, args.seed, args.any_photos, args.objects)
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if args.out:
        atomic_write_text(args.out.with_suffix(".json"), text + "\n")


if __name__ == "__main__":
    main()
