"""Fit the synthetic generator's cluster parameters to real embeddings (bench/vector_data.py's CALIBRATED).

    python bench/calibrate_synthetic.py --cars196 /work/shared/data/cars196 --cache-dir /work/cache/dmlsearch

Real: the pretrained Cars196 views (``real`` data of bench/index_bench.py), queries held-out images.
Synthetic: the same gallery size and query count, seeds from the real view-0 embeddings projected
to ``DIM``. For every point of a small grid over (cluster size, member cosine, centre cosine, shared
weight) it measures both statistics of bench/vector_data.py and scores the distance to the real ones:
the mean absolute difference of the 10th-neighbour cosine's quantiles plus that of the nearest-cell
fraction (both are in cosine / fraction units, so they weigh alike). The best point is printed; copy
it into CALIBRATED.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm
from vector_data import (
    CALIBRATED,
    DIM,
    OLD,
    QUANTILES,
    SEEDS,
    ClusterParams,
    cars196_seeds,
    data_statistics,
    embedding_like,
    real_embeddings,
    real_split,
)

from index.atomic import atomic_write_text
from index.sources import ArraySource
from index.tuning import exact_neighbours

CLUSTER_SIZES = (13, 25, 50)
MEMBER_COSINES = (0.9, 0.94, 0.97)
CENTRE_COSINES = (0.9, 0.95, 0.98)
SHARED_WEIGHTS = (0.0, 0.3, 0.45, 0.6)


def statistics_of(base: np.ndarray, queries: np.ndarray) -> dict:
    truth = exact_neighbours(queries, [ArraySource(np.arange(len(base)), base)], 10)
    return data_statistics(base, queries, truth)


def distance(stats: dict, target: dict) -> float:
    """Mean absolute quantile difference of the 10th-neighbour cosine + the nearest-cell fraction's."""
    cosines = np.mean(
        [abs(stats["tenth_cosine"][q] - target["tenth_cosine"][q]) for q in target["tenth_cosine"]]
    )
    return float(cosines + abs(stats["nearest_cell_fraction"] - target["nearest_cell_fraction"]))


def synthetic_statistics(params: ClusterParams, count: int, queries: int, seeds: np.ndarray) -> dict:
    base, held_out = embedding_like(count, queries, seeds, np.random.default_rng(0), params)
    return statistics_of(base, held_out)


def row_text(name: str, stats: dict, target: dict) -> str:
    cosines = " | ".join(f"{stats['tenth_cosine'][q]:.3f}" for q in stats["tenth_cosine"])
    return f"| {name} | {cosines} | {stats['nearest_cell_fraction']:.3f} | {distance(stats, target):.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cars196", type=Path, required=True, help="Cars196 folder holding labels.csv")
    parser.add_argument("--cache-dir", type=Path, required=True, help="feature cache (shared with training)")
    parser.add_argument("--chunks", type=int, help="only the first chunks of 1024 images (default: all)")
    parser.add_argument("--queries", type=int, default=1000, help="held-out images")
    parser.add_argument("--out", type=Path, default=Path("bench/results/synthetic_calibration"))
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="no grid: only compare CALIBRATED and OLD with the real data (at sizes too slow for the grid)",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    views = real_embeddings(args.cars196, args.cache_dir, chunks=args.chunks)
    base, queries = real_split(views, args.queries, rng)
    target = statistics_of(base, queries)
    seeds = cars196_seeds(args.cars196, args.cache_dir, rng)
    points = itertools.product(CLUSTER_SIZES, MEMBER_COSINES, CENTRE_COSINES, SHARED_WEIGHTS)
    grid = [] if args.check_only else [ClusterParams(*point) for point in points]
    fits = []
    for params in tqdm(grid, desc="synthetic grid", unit="point"):
        stats = synthetic_statistics(params, len(base), len(queries), seeds)
        fits.append({"params": vars(params), "stats": stats, "distance": distance(stats, target)})
    fits.sort(key=lambda fit: fit["distance"])
    old = synthetic_statistics(OLD, len(base), len(queries), seeds)
    current = synthetic_statistics(CALIBRATED, len(base), len(queries), seeds)
    meta = {
        "command": "python bench/calibrate_synthetic.py " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "real_images": views.shape[1],
        "views": views.shape[0],
        "gallery": len(base),
        "queries": len(queries),
    }
    atomic_write_text(
        args.out.with_suffix(".json"),
        json.dumps({"meta": meta, "real": target, "old": old, "calibrated": current, "fits": fits}, indent=2),
    )
    quantiles = " | ".join(f"10th cos p{round(100 * q)}" for q in QUANTILES)
    lines = [
        "# Synthetic embedding-like data calibrated on real embeddings",
        "",
        f"`{meta['command']}`, {meta['date']}, load average {meta['load']} (2 shared cores).",
        f"Real: {meta['views']} views of {meta['real_images']} readable Cars196 images through the "
        f"pretrained EfficientNet-Lite0 (1280-d); gallery {meta['gallery']:,} vectors (every view of all but "
        f"{meta['queries']} images), queries view 0 of the {meta['queries']} held-out images. Synthetic: "
        f"{DIM}-d, the same gallery size and query count, seeds {SEEDS} real view-0 embeddings (first 1024 "
        f"images) projected to {DIM}-d, queries one member of each of {meta['queries']} held-out clusters. "
        f"Nearest cell: the product's IVF quantizer ({target['nlist']} lists) trained on the gallery. "
        "Distance: mean absolute difference of the quantiles + that of the nearest-cell fraction, to the "
        "real row.",
        "",
        f"| data | {quantiles} | nearest-cell fraction | distance |",
        "|---|" + "---|" * (len(QUANTILES) + 2),
        row_text("real", target, target),
        row_text(f"synthetic, calibrated {vars(CALIBRATED)}", current, target),
        row_text(f"synthetic, old {vars(OLD)}", old, target),
    ]
    if fits:
        lines += [
            "",
            f"Grid ({len(grid)} points), best first:",
            "",
            f"| params | {quantiles} | nearest-cell fraction | distance |",
            "|---|" + "---|" * (len(QUANTILES) + 2),
            *(row_text(str(fit["params"]), fit["stats"], target) for fit in fits),
        ]
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    if fits:
        print(f"best: {fits[0]['params']} (distance {fits[0]['distance']:.3f})")


if __name__ == "__main__":
    main()
