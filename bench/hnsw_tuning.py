"""How well do an HNSW graph's tuning queries stand in for new images? efSearch against recall@10.

    python bench/hnsw_tuning.py --cars196 DATA --cache-dir CACHE     # 1M vectors: about 15 minutes on 2 cores

Tuning (index/tuning.py) cannot search with new photos: it holds gallery vectors out and measures how
well the graph finds their neighbours. This bench draws, at each efSearch, the recall@10 of

- ``new images``: the benchmark's queries (bench/index_bench.py's calibrated ``embedding`` data, the same
  vectors at the same size and seed), which is what the target is about;
- ``held out, copies in graph``: held-out gallery vectors' plain top-10 in a graph without them (their
  near copies, the other views of their image, are in the graph and found first);
- ``held out, past N``: the same graph searched for 10 + N, the query's N nearest dropped (what IVF tuning
  measures);
- ``held out, N left out``: a graph also built without each query's N nearest (``graph_set_aside``, what
  HNSW tuning measures).

Writes ``bench/results/hnsw_tuning.{json,md,png}``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import matplotlib
from lib.options import bench_parser, out_option

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from lib.vector_data import ArraySource, cars196_seeds, embedding_like

from foundation.atomic import atomic_write_text
from index.faiss_build import tuning_set_aside
from index.faiss_index import FaissIndex, faiss_module
from index.selection import IndexOptions, IndexSpec, choose_index
from index.tuning import (
    NEIGHBOURHOOD,
    exact_neighbours,
    held_out_ids,
    outside,
    recall_at_k,
)

K = 10
EF_VALUES = (16, 24, 32, 48, 64, 96, 128, 192, 256)
LATENCY_QUERIES = 300
TRAIN_SAMPLE = 65_536


def graph_without(
    spec: IndexSpec, base: np.ndarray, ids: np.ndarray, left_out: np.ndarray
) -> tuple[FaissIndex, ArraySource]:
    """A ``spec`` graph over every vector but ``left_out``, and those vectors."""
    kept = ~np.isin(ids, left_out)
    source = ArraySource(ids[kept], base[kept])
    index = FaissIndex.create(spec)
    began = time.perf_counter()
    if not index.is_trained:  # quantised storage (e.g. HNSW32_SQ8): trained on a sample
        index.train(
            base[np.random.default_rng(0).choice(len(base), min(TRAIN_SAMPLE, len(base)), replace=False)]
        )
    for chunk_ids, vectors in source.iter_vectors(65_536):
        index.add(chunk_ids, vectors)
    print(f"  built {index.spec.factory} over {len(index):,} vectors in {time.perf_counter() - began:.0f} s")
    return index, source


def search(index: FaissIndex, queries: np.ndarray, k: int, ef: int) -> np.ndarray:
    index.set_search_params({"efSearch": ef})
    return index.search(queries, k, exhaustive_when_short=False)[0]


def single_query_ms(index: FaissIndex, queries: np.ndarray, ef: int) -> float:
    index.set_search_params({"efSearch": ef})
    times = []
    for query in queries[:LATENCY_QUERIES]:
        began = time.perf_counter()
        index.search(query[None, :], K)
        times.append((time.perf_counter() - began) * 1000.0)
    return float(np.median(times))


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/hnsw_tuning")))
    parser.add_argument(
        "--cars196", type=Path, required=True, help="Cars196 folder: the synthetic data's seeds"
    )
    parser.add_argument("--cache-dir", type=Path, required=True, help="feature cache of the real views")
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--factory", help="another faiss factory string than the automatic graph's")
    args = parser.parse_args()
    faiss_module().omp_set_num_threads(os.cpu_count() or 1)
    began = time.perf_counter()
    rng = np.random.default_rng(0)  # as bench/index_bench.py: the same seeds and vectors
    base, queries = embedding_like(
        args.size, args.queries, cars196_seeds(args.cars196, args.cache_dir, rng), rng
    )
    ids = np.arange(len(base), dtype=np.int64)
    spec = choose_index(len(base), base.shape[1], IndexOptions("hnsw"))
    if args.factory:
        spec = IndexSpec("hnsw", args.factory, spec.dim)
    curves: dict[str, list[float]] = {}

    held = held_out_ids(ids)
    graph, rest = graph_without(spec, base, ids, held)
    truth = exact_neighbours(queries, [rest], K)  # of what the graph holds
    ranked = exact_neighbours(base[held], [rest], K + NEIGHBOURHOOD)
    curves["new images"] = [recall_at_k(search(graph, queries, K, ef), truth) for ef in EF_VALUES]
    latency = [single_query_ms(graph, queries, ef) for ef in EF_VALUES]
    curves["held out, copies in graph"] = [
        recall_at_k(search(graph, base[held], K, ef), ranked[:, :K]) for ef in EF_VALUES
    ]
    curves[f"held out, past {NEIGHBOURHOOD}"] = [
        recall_at_k(
            outside(search(graph, base[held], K + NEIGHBOURHOOD, ef), ranked[:, :NEIGHBOURHOOD], K),
            ranked[:, NEIGHBOURHOOD:],
        )
        for ef in EF_VALUES
    ]
    del graph

    tuning_queries, aside = tuning_set_aside(spec, [ArraySource(ids, base)], ids)  # as the builder does
    graph, rest = graph_without(spec, base, ids, aside)
    truth_aside = exact_neighbours(tuning_queries, [rest], K)
    curves[f"held out, {NEIGHBOURHOOD} left out (tuning)"] = [
        recall_at_k(search(graph, tuning_queries, K, ef), truth_aside) for ef in EF_VALUES
    ]

    meta = {
        "command": "python bench/hnsw_tuning.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, faiss "
        f"{faiss_module().__version__}",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "wall_min": round((time.perf_counter() - began) / 60, 1),
        "size": args.size,
        "factory": graph.spec.factory,
        "queries": args.queries,
        "neighbourhood": NEIGHBOURHOOD,
    }
    result = {"meta": meta, "ef": list(EF_VALUES), "curves": curves, "single_query_p50_ms": latency}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(result, indent=2))
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, values in curves.items():
        axis.plot(EF_VALUES, values, marker="o", label=name)
    axis.axhline(0.95, color="grey", linestyle=":", label="target 0.95")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("efSearch")
    axis.set_ylabel("recall@10")
    axis.set_title(f"{graph.spec.factory} over {args.size:,} calibrated vectors")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out.with_suffix(".png"), dpi=120)
    header = "| efSearch | single p50 ms | " + " | ".join(curves) + " |"
    lines = [
        "# HNSW tuning proxies against new images (bench/hnsw_tuning.py)",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}, {meta['wall_min']} min.",
        "",
        f"`{meta['factory']}`: recall@10 at each efSearch on {args.size:,} calibrated vectors "
        f"({args.queries} new images; held-out gallery vectors as index/tuning.py picks them). "
        "Single-query p50 on the graph without the held-out vectors, new images.",
        "",
        header,
        "|" + "---|" * (len(curves) + 2),
        *(
            f"| {ef} | {ms:.3f} | " + " | ".join(f"{values[n]:.3f}" for values in curves.values()) + " |"
            for n, (ef, ms) in enumerate(zip(EF_VALUES, latency, strict=True))
        ),
        "",
        f"![recall against efSearch]({args.out.with_suffix('.png').name})",
        "",
    ]
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
