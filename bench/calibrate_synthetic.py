"""Fit the synthetic generator's growth to real embeddings (bench/lib/vector_data.py's CALIBRATED).

    python bench/calibrate_synthetic.py --cars196 /work/shared/data/cars196 --cache-dir /work/cache/dmlsearch

Real: the pretrained Cars196 views of all images (``real`` data of bench/index_bench.py), queries held-out
images. Synthetic: the same gallery size and query count, grown from seed images (bench/lib/vector_data.py's
``embedding_like``). The 1M rows grow about 5x from Cars196's images, so the fit scores growth: for every
point of a small grid over (class spread, view scale) the generator grows the images of the first
``--fit-chunks`` chunks to the whole real gallery's size (about 4x) and is scored against the whole real
data's two statistics (bench/lib/vector_data.py): the mean absolute difference of the 10th-neighbour cosine's
quantiles plus that of the nearest-cell fraction (both in cosine / fraction units, so they weigh alike).
The best point is then also grown 1x from all the images. Copy it into CALIBRATED.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
from lib.options import bench_parser, out_option
from lib.vector_data import (
    CALIBRATED,
    CHUNK_IMAGES,
    DIM,
    QUANTILES,
    ArraySource,
    GrowthParams,
    SeedImages,
    cars196_seeds,
    data_statistics,
    embedding_like,
    real_embeddings,
    real_split,
    seed_images,
)
from tqdm import tqdm

from foundation.atomic import atomic_write_text
from index.tuning import exact_neighbours

CLASS_SPREADS = (0.5, 1.0, 1.5, 2.0, 3.0, 5.0)
VIEW_SCALES = (0.8, 1.0, 1.2)


def statistics_of(base: np.ndarray, queries: np.ndarray) -> dict:
    truth = exact_neighbours(queries, [ArraySource(np.arange(len(base)), base)], 10)
    return data_statistics(base, queries, truth)


def distance(stats: dict, target: dict) -> float:
    """Mean absolute quantile difference of the 10th-neighbour cosine + the nearest-cell fraction's."""
    cosines = np.mean(
        [abs(stats["tenth_cosine"][q] - target["tenth_cosine"][q]) for q in target["tenth_cosine"]]
    )
    return float(cosines + abs(stats["nearest_cell_fraction"] - target["nearest_cell_fraction"]))


def synthetic_statistics(params: GrowthParams, count: int, queries: int, seeds: SeedImages) -> dict:
    base, held_out = embedding_like(count, queries, seeds, np.random.default_rng(0), params)
    return statistics_of(base, held_out)


def row_text(name: str, stats: dict, target: dict) -> str:
    cosines = " | ".join(f"{stats['tenth_cosine'][q]:.3f}" for q in stats["tenth_cosine"])
    return f"| {name} | {cosines} | {stats['nearest_cell_fraction']:.3f} | {distance(stats, target):.3f} |"


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/synthetic_calibration")))
    parser.add_argument("--cars196", type=Path, required=True, help="Cars196 folder holding labels.csv")
    parser.add_argument("--cache-dir", type=Path, required=True, help="feature cache (shared with training)")
    parser.add_argument(
        "--fit-chunks", type=int, default=4, help="chunks of 1024 images whose growth is fitted"
    )
    parser.add_argument("--queries", type=int, default=1000, help="held-out images")
    parser.add_argument(
        "--check-only", action="store_true", help="no grid: only grow CALIBRATED (4x and 1x) and compare"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    views, labels = real_embeddings(args.cars196, args.cache_dir)
    base, queries = real_split(views, args.queries, rng)
    target = statistics_of(base, queries)
    all_seeds = seed_images(views, labels, rng)
    del views
    fit_seeds = cars196_seeds(args.cars196, args.cache_dir, rng, chunks=args.fit_chunks)
    grid = (
        []
        if args.check_only
        else list(itertools.starmap(GrowthParams, itertools.product(CLASS_SPREADS, VIEW_SCALES)))
    )
    fits = []
    for params in tqdm(grid, desc="synthetic grid", unit="point"):
        stats = synthetic_statistics(params, len(base), len(queries), fit_seeds)
        fits.append({"params": vars(params), "stats": stats, "distance": distance(stats, target)})
    fits.sort(key=lambda fit: fit["distance"])
    fitted = GrowthParams(**fits[0]["params"]) if fits else CALIBRATED
    grown = fits[0]["stats"] if fits else synthetic_statistics(fitted, len(base), len(queries), fit_seeds)
    one_to_one = synthetic_statistics(fitted, len(base), len(queries), all_seeds)
    # No departure, one image a seed: the seeds' own views, only projected (what DIM costs the statistics).
    copies = GrowthParams(class_spread=0.0, view_scale=1.0)
    projected = synthetic_statistics(copies, len(base), len(queries), all_seeds)
    meta = {
        "command": "python bench/calibrate_synthetic.py " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "real_images": len(all_seeds),
        "views": len(all_seeds.view_offsets) + 1,
        "gallery": len(base),
        "queries": len(queries),
        "fit_images": len(fit_seeds),
        "fitted": vars(fitted),
    }
    atomic_write_text(
        args.out.with_suffix(".json"),
        json.dumps(
            {
                "meta": meta,
                "real": target,
                "grown": grown,
                "one_to_one": one_to_one,
                "projected": projected,
                "fits": fits,
            },
            indent=2,
        ),
    )
    quantiles = " | ".join(f"10th cos p{round(100 * q)}" for q in QUANTILES)
    header = [
        f"| data | {quantiles} | nearest-cell fraction | distance |",
        "|---|" + "---|" * (len(QUANTILES) + 2),
    ]
    growth = meta["gallery"] / (meta["fit_images"] * meta["views"])
    lines = [
        "# Synthetic embedding-like data calibrated on real embeddings",
        "",
        f"`{meta['command']}`, {meta['date']}, load average {meta['load']} (2 shared cores).",
        f"Real: {meta['views']} views of {meta['real_images']:,} readable Cars196 images through the "
        f"pretrained EfficientNet-Lite0 (1280-d); gallery {meta['gallery']:,} vectors (every view of all but "
        f"{meta['queries']} images), queries view 0 of the {meta['queries']} held-out images. Synthetic "
        f"({DIM}-d, bench/lib/vector_data.py's embedding_like): the same gallery size and query count, new "
        "images "
        "grown from seed images (real images, every view through one random projection): a smoothed "
        "bootstrap of the seed's class, its views the seed's real view offsets; queries view 0 of "
        "held-out new images. Nearest cell: the product's IVF quantizer "
        f"({target['nlist']} lists) trained on the gallery. Distance: mean absolute difference of the "
        "quantiles + that of the nearest-cell fraction, to the real row.",
        "",
        f"{'Checked (CALIBRATED, no grid)' if args.check_only else 'Fitted (best of the grid below)'}: "
        f"{meta['fitted']}",
        "",
        *header,
        row_text("real", target, target),
        row_text(
            f"synthetic, grown {growth:.1f}x from the first {args.fit_chunks} chunks' "
            f"{meta['fit_images']:,} images ({'checked' if args.check_only else 'fitted'})",
            grown,
            target,
        ),
        row_text(f"synthetic, grown 1x from all {meta['real_images']:,} images", one_to_one, target),
        row_text(
            f"synthetic, 1x from all images at {vars(copies)} (the real views, projected)", projected, target
        ),
    ]
    if fits:
        lines += [
            "",
            f"Grid ({len(grid)} points), grown {growth:.1f}x from the first {args.fit_chunks} chunks of "
            f"{CHUNK_IMAGES} images, best first:",
            "",
            *header,
            *(row_text(str(fit["params"]), fit["stats"], target) for fit in fits),
        ]
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
