"""Vector-index benchmark: every FAISS index type and Milvus Lite on real, embedding-like and uniform vectors.

    python bench/index_bench.py --sizes 100k            # a few minutes on 2 cores
    python bench/index_bench.py --sizes 100k,1M --milvus-max 100k --skip hnsw@uniform:1M   # about an hour
    python bench/index_bench.py --data real --cars196 DATA --cache-dir CACHE --out OUT  # about 210k vectors

For each data set and size: build time (train + add + tuning), index size, query latency p50/p99 for
single queries and for batches of 64, and recall@10 against exact search on 1,000 held-out queries
(never added to the index). Approximate FAISS indexes are tuned at build time to reach recall@10 >=
--target-recall on their own held-out sample (index/tuning.py: it stops short at a quantisation ceiling
or at searches slower than 20 ms a query); the table shows what they reach on the benchmark's queries.
All rows of one run share the machine, so their ratios compare. Rows left out (--skip, Milvus above
--milvus-max) are listed under the table with what the nearest measured row cost.

Data (bench/lib/vector_data.py): ``real``, pretrained embeddings of 13 views of every Cars196 image (1280-d,
about 210k vectors; queries are held-out images), extracted once into --cache-dir; ``embedding``, a
512-d synthetic stand-in at any size, new images grown from seed images with a growth calibrated on
``real`` (seeds: the real images projected to 512-d with --cars196, random classes otherwise);
``uniform``, random unit vectors. Every
data set's row in the statistics table gives its 10th-neighbour cosines and nearest-IVF-cell fraction.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from lib.options import bench_parser, out_option
from lib.vector_data import (
    CALIBRATED,
    DIM,
    QUANTILES,
    RANDOM_SEED_CLASSES,
    RANDOM_SEED_IMAGES,
    ArraySource,
    K,
    cars196_files,
    cars196_seeds,
    data_statistics,
    embedding_like,
    random_seed_images,
    real_embeddings,
    real_split,
    uniform,
)
from tqdm import tqdm

from foundation.atomic import atomic_write_text
from index import tuning as tuning_module
from index.faiss_build import build_faiss_index
from index.faiss_index import faiss_module
from index.protocol import Entry
from index.selection import IndexOptions, IndexSpec, choose_index, format_bytes, parse_size
from index.tuning import exact_neighbours, recall_at_k

MILVUS_TUNING_QUERIES = 500
NUMPY_CHECK_QUERIES = 100


def count_of(text: str) -> int:
    """``100k`` -> 100000, ``1M`` -> 1000000."""
    return int(float(text.strip().lower().replace("k", "e3").replace("m", "e6")))


def skip_entry(text: str) -> tuple[str, str, int]:
    """``hnsw@uniform:1M`` -> ("hnsw", "uniform", 1000000): a type left out for one data set and size."""
    index_type, _, rest = text.partition("@")
    data, _, size = rest.partition(":")
    if not (index_type and data and size):
        raise argparse.ArgumentTypeError(f"--skip takes TYPE@DATA:SIZE, e.g. hnsw@uniform:1M; got {text!r}")
    return index_type, data, count_of(size)


def latencies(
    search: Callable[[np.ndarray], object], queries: np.ndarray, batch: int, budget_s: float
) -> dict:
    """p50/p99 milliseconds per call of ``batch`` queries, over at most ``budget_s`` seconds of calls."""
    times = []
    spent = 0.0
    for start in range(0, len(queries) - batch + 1, batch):
        began = time.perf_counter()
        search(queries[start : start + batch])
        times.append((time.perf_counter() - began) * 1000.0)
        spent += times[-1] / 1000.0
        if spent > budget_s and len(times) >= 5:
            break
    return {
        "p50_ms": float(np.percentile(times, 50)),
        "p99_ms": float(np.percentile(times, 99)),
        "calls": len(times),
    }


def measure(
    label: str,
    search: Callable[[np.ndarray], np.ndarray],
    queries: np.ndarray,
    truth: np.ndarray,
    budget_s: float,
) -> dict:
    found = np.concatenate([search(queries[i : i + 256]) for i in range(0, len(queries), 256)])
    row = {
        "index": label,
        "recall_at_10": recall_at_k(found, truth),
        "single": latencies(search, queries, 1, budget_s),
        "batch64": latencies(search, queries, 64, budget_s),
    }
    tqdm.write(f"  {label}: recall@10 {row['recall_at_10']:.3f}, single p50 {row['single']['p50_ms']:.3f} ms")
    return row


def numpy_agreement(index: object, base: np.ndarray, queries: np.ndarray) -> int:
    """How many of the first ``NUMPY_CHECK_QUERIES`` get the same top-10 ids from ``index`` as from a numpy
    brute force (the exact index must agree on all)."""
    queries = queries[:NUMPY_CHECK_QUERIES]
    found = index.search(queries, K)[0]
    agree = 0
    for query, ids in zip(queries, found, strict=True):
        scores = base @ query
        top = np.argpartition(-scores, K)[:K]
        agree += set(top.tolist()) == set(ids.tolist())
    return agree


def bench_faiss(
    label: str,
    spec: IndexSpec,
    base: np.ndarray,
    queries: np.ndarray,
    truth: np.ndarray,
    target: float,
    budget_s: float,
) -> dict:
    faiss = faiss_module()
    began = time.perf_counter()
    index, tuning = build_faiss_index(
        spec, [ArraySource(np.arange(len(base)), base)], target_recall=target, progress=True
    )
    build_s = time.perf_counter() - began
    row = measure(label, lambda q: index.search(q, K)[0], queries, truth, budget_s)
    row.update(
        spec=spec.factory,
        build_s=build_s,
        index_bytes=int(faiss.serialize_index(index.index).nbytes),
        estimated_bytes=spec.memory_bytes(len(base)),
        search_params=tuning.params,
        tuned_recall=tuning.recall,
    )
    if spec.index_type == "flat":
        row["numpy_check"] = {
            "queries": NUMPY_CHECK_QUERIES,
            "same_top10": numpy_agreement(index, base, queries),
        }
    return row


def tune_milvus_ef(
    search: Callable[[np.ndarray], np.ndarray],
    backend: object,
    queries: np.ndarray,
    truth: np.ndarray,
    target: float,
) -> float:
    """Set the smallest graph beam ``ef`` (doubling from 16) reaching ``target`` recall@10 on ``queries``;
    return the recall reached. Milvus tunes nothing itself (Lite's AUTOINDEX is a graph searched with
    ``ef``); like the FAISS indexes, it is tuned on queries other than the benchmark's."""
    for ef in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        backend.search_params = {"ef": ef}
        recall = recall_at_k(search(queries), truth)
        if recall >= target:
            break
    return recall


def bench_milvus(
    base: np.ndarray, queries: np.ndarray, truth: np.ndarray, tuning: tuple, args: argparse.Namespace
) -> dict:
    from index.manifest import Manifest
    from index.milvus_backend import MilvusBackend

    with tempfile.TemporaryDirectory() as workdir:
        now = dt.datetime.now(dt.UTC).isoformat()
        manifest = Manifest(
            backend="milvus", dim=base.shape[1], model_fingerprint="bench", created=now, updated=now
        )
        began = time.perf_counter()
        backend = MilvusBackend.connect(Path(workdir), manifest, manifest.milvus, create=True)
        milvus_ids = []
        for start in tqdm(range(0, len(base), 5000), desc="inserting into Milvus Lite", unit="batch"):
            chunk = base[start : start + 5000]
            milvus_ids += backend.add(chunk, [Entry(f"v{start + i}", None, "") for i in range(len(chunk))])
        backend.save()
        while backend.client.describe_index(backend.collection, "vector").get("pending_index_rows", 0):
            time.sleep(0.5)  # searches are brute force over segments still being indexed
        # Load the flushed collection afresh, as a server starting on it does: searching the collection
        # that was loaded before the inserts measured 6x slower (122 vs 20 ms at 30k vectors).
        backend.client.release_collection(backend.collection)
        backend.client.load_collection(backend.collection)
        build_s = time.perf_counter() - began
        order = np.argsort(milvus_ids)
        sorted_ids = np.asarray(milvus_ids)[order]

        def search(q: np.ndarray) -> np.ndarray:
            """Milvus's own ids mapped back to the rows of ``base`` that the exact truth uses."""
            found = backend.search(q, K)[0]
            rows = order[np.clip(np.searchsorted(sorted_ids, found), 0, len(order) - 1)]
            return np.where(found >= 0, rows, -1)

        tuned_recall = tune_milvus_ef(search, backend, *tuning, args.target_recall)
        row = measure("milvus-lite", search, queries, truth, args.latency_budget)
        row.update(
            spec=f"{backend.built_index().index_type} (COSINE)",
            build_s=build_s,
            index_bytes=sum(p.stat().st_size for p in Path(workdir).rglob("*") if p.is_file()),
            search_params=backend.search_params,
            tuned_recall=tuned_recall,
        )
        backend.close()
    return row


def run_size(
    name: str, base: np.ndarray, held_out: np.ndarray, args: argparse.Namespace
) -> tuple[list[dict], list[dict], dict]:
    """The measured rows for one data set and size, the rows left out (``--skip``, ``--milvus-max``) and
    the data's statistics (bench/lib/vector_data.py)."""
    count, dim = base.shape
    tqdm.write(f"{name} x {count}: exact ground truth")
    truth = exact_neighbours(held_out, [ArraySource(np.arange(count), base)], K)
    tqdm.write(f"{name} x {count}: 10th-neighbour cosines and nearest IVF cells")
    statistics = {"data": name, "count": count, "dim": dim, **data_statistics(base, held_out, truth)}
    # The first queries measure every index; the rest tune Milvus (FAISS holds out its own at build time).
    queries, truth, tuning = (
        held_out[: args.queries],
        truth[: args.queries],
        (held_out[args.queries :], truth[args.queries :]),
    )
    rows, left_out = [], []
    budget = args.memory_budget
    # ivfpq gets the largest code that fits the budget; the others are what their type builds at this size.
    specs = [choose_index(count, dim, IndexOptions(t, budget if t == "ivfpq" else None)) for t in args.types]
    auto = choose_index(count, dim, IndexOptions())
    auto_budgeted = choose_index(count, dim, IndexOptions(memory_budget=budget))
    if auto_budgeted not in specs:
        specs.append(auto_budgeted)
    for spec in specs:
        if (spec.index_type, name, count) in args.skip:
            tqdm.write(f"{name} x {count}: {spec.index_type} skipped (--skip)")
            left_out.append({"index": spec.index_type, "data": name, "count": count, "why": "--skip"})
            continue
        label = spec.index_type + (f" within {format_bytes(budget)}" if spec.index_type == "ivfpq" else "")
        chosen_by = [
            note
            for note, chosen in (("auto", auto), (f"auto within {format_bytes(budget)}", auto_budgeted))
            if spec == chosen
        ]
        label += f" ({'; '.join(chosen_by)})" if chosen_by else ""
        tqdm.write(f"{name} x {count}: {label} {spec.factory}")
        rows.append(bench_faiss(label, spec, base, queries, truth, args.target_recall, args.latency_budget))
    if args.milvus_max and count <= args.milvus_max:
        rows.append(bench_milvus(base, queries, truth, tuning, args))
    elif args.milvus_max:
        left_out.append({"index": "milvus-lite", "data": name, "count": count, "why": "above --milvus-max"})
    exact = next((r for r in rows if r["index"].startswith("flat")), None)
    for row in rows:
        row.update(data=name, count=count, dim=dim)
        if exact is not None:
            row["speedup_single_vs_exact"] = exact["single"]["p50_ms"] / row["single"]["p50_ms"]
    return rows, left_out, statistics


def _kind(row: dict) -> str:
    """``ivfpq within 512.0 MiB (auto ...)`` -> ``ivfpq``: the index type a row measured."""
    return row["index"].split()[0]


def _nearest_measured(rows: list[dict], missing: dict) -> dict | None:
    """The largest measured row of the same index type and data, smaller than the one left out."""
    smaller = [
        r
        for r in rows
        if _kind(r) == missing["index"] and r["data"] == missing["data"] and r["count"] < missing["count"]
    ]
    return max(smaller, key=lambda r: r["count"], default=None)


def left_out_notes(rows: list[dict], left_out: list[dict]) -> list[str]:
    """One line per row left out, with what the nearest measured row of its kind cost."""
    lines = []
    for missing in left_out:
        line = (
            f"- {missing['index']} on {missing['data']} at {missing['count']:,}: not run ({missing['why']})"
        )
        near = _nearest_measured(rows, missing)
        if near is not None:
            scale = missing["count"] / near["count"]
            params = ", ".join(f"{k}={v}" for k, v in near.get("search_params", {}).items())
            line += (
                f". At {near['count']:,} it took {near['build_s']:.0f} s to build ({params}: recall@10 "
                f"{near['recall_at_10']:.3f}, {near['single']['p50_ms']:.1f} ms a single query); "
                f"{scale:.0f}x the vectors take at least {scale:.0f}x that, "
                f"{near['build_s'] * scale / 60:.0f} min"
            )
        lines.append(line + ".")
    return lines


def statistics_lines(statistics: list[dict]) -> list[str]:
    quantiles = " | ".join(f"10th cos p{round(100 * q)}" for q in QUANTILES)
    lines = [
        "",
        "The data, on the held-out queries (bench/lib/vector_data.py): quantiles of each query's cosine to "
        "its 10th exact neighbour, and the fraction of its true top-10 in its nearest IVF cell "
        "(the product's quantizer for this size trained on the gallery):",
        "",
        f"| data | n | dim | {quantiles} | nearest-cell fraction (lists) |",
        "|---|---|---|" + "---|" * (len(QUANTILES) + 1),
    ]
    for s in statistics:
        cosines = " | ".join(f"{value:.3f}" for value in s["tenth_cosine"].values())
        lines.append(
            f"| {s['data']} | {s['count']:,} | {s['dim']} | {cosines} "
            f"| {s['nearest_cell_fraction']:.3f} ({s['nlist']}) |"
        )
    return lines


def markdown(rows: list[dict], left_out: list[dict], statistics: list[dict], meta: dict) -> str:
    lines = [
        "# Vector-index benchmark",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}; {meta['wall_min']:.0f} min wall time; "
        f"load average {meta['load']} at the start and {meta['load_end']} at the end (shared cores).",
        f"Recall@10 against exact search on {meta['queries']} held-out queries; FAISS indexes tuned to "
        f"recall@10 >= {meta['target_recall']} at build time (IVF: each tuning query's "
        f"{meta['tuning_neighbourhood']} nearest gallery vectors set aside). Latency in ms (single query; "
        "batch of 64).",
        f"Embedding-like data: new images grown from seed images {meta['growth_params']} (calibrated on the "
        f"real views' growth: bench/results/synthetic_calibration.md), seeds {meta['seeds']}. Milvus Lite's "
        f"ef is tuned the same way on {MILVUS_TUNING_QUERIES} other held-out queries. Size: the serialised "
        "FAISS index, Milvus Lite's files on disk. Build: train + add + tune. * after the params: tuning "
        "stopped short of the target (a quantisation ceiling, or searches slower than 20 ms a query).",
        "",
        "| data | n | index | spec | build s | size | recall@10 | single p50 | single p99 | batch64 p50 "
        "| batch64 p99 | vs exact | params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r.get("speedup_single_vs_exact")
        speedup = "-" if ratio is None else f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"
        params = ", ".join(f"{k}={v}" for k, v in r.get("search_params", {}).items()) or "-"
        params += " *" if r.get("tuned_recall", 1.0) < meta["target_recall"] else ""
        lines.append(
            f"| {r['data']} | {r['count']:,} | {r['index']} | `{r['spec']}` | {r['build_s']:.1f} "
            f"| {format_bytes(r['index_bytes'])} | {r['recall_at_10']:.3f} | {r['single']['p50_ms']:.3f} "
            f"| {r['single']['p99_ms']:.3f} | {r['batch64']['p50_ms']:.2f} | {r['batch64']['p99_ms']:.2f} "
            f"| {speedup} | {params} |"
        )
    if "real" in meta:
        real = meta["real"]
        lines += [
            "",
            f"Real data: {real['views']} views (view 0 the serving preprocessing, the others seeded random "
            f"resized crops with flips) of {real['images']:,} readable Cars196 images "
            f"({real['of_images']:,} in the data set) through the pretrained EfficientNet-Lite0 (the model "
            "`dmlsearch export` writes without a run: pooled, L2-normalised, 1280-d); queries view 0 of "
            "held-out images, none of whose views is in the gallery.",
        ]
    lines += statistics_lines(statistics)
    checks = [r for r in rows if "numpy_check" in r]
    if checks:
        lines += ["", "Exact search (flat) against a numpy brute-force top-10:"]
        lines += [
            f"- {r['data']} at {r['count']:,}: the same top-10 ids for {r['numpy_check']['same_top10']} of "
            f"{r['numpy_check']['queries']} queries"
            for r in checks
        ]
    if left_out:
        lines += [
            "",
            "Left out of this run, to keep it to about an hour on 2 shared cores:",
            *left_out_notes(rows, left_out),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/index_bench")))
    parser.add_argument("--sizes", default="100k", help="comma-separated gallery sizes, e.g. 100k,1M")
    parser.add_argument("--data", default="embedding,uniform", help="embedding and/or uniform")
    parser.add_argument("--types", default="flat,hnsw,ivf,ivfsq,ivfpq", help="FAISS index types to build")
    parser.add_argument(
        "--memory-budget", type=parse_size, default=parse_size("512MB"), help="for ivfpq and the auto row"
    )
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument(
        "--milvus-max",
        type=count_of,
        default=1_000_000,
        help="skip Milvus Lite above this size (0: never)",
    )
    parser.add_argument(
        "--skip",
        type=skip_entry,
        action="append",
        default=[],
        help="leave an index type out for one data set and size, e.g. hnsw@uniform:1M (repeatable)",
    )
    parser.add_argument("--latency-budget", type=float, default=20.0, help="seconds per latency measurement")
    parser.add_argument(
        "--cars196",
        type=Path,
        help="Cars196 folder (labels.csv, images/): the real data and the embedding data's seeds",
    )
    parser.add_argument("--cache-dir", type=Path, help="feature cache of the real views (with --cars196)")
    parser.add_argument("--real-chunks", type=int, help="real data: only the first chunks of 1024 images")
    parser.add_argument(
        "--tuning-neighbourhood",
        type=int,
        default=tuning_module.NEIGHBOURHOOD,
        help="nearest gallery vectors set aside per IVF tuning query (0: the tuning before they were)",
    )
    args = parser.parse_args()
    tuning_module.NEIGHBOURHOOD = args.tuning_neighbourhood
    args.types = args.types.split(",")
    names = args.data.split(",")
    if args.cars196 is not None and args.cache_dir is None:
        parser.error("--cars196 needs --cache-dir")
    if "real" in names and args.cars196 is None:
        parser.error("--data real needs --cars196 and --cache-dir")
    sizes = [count_of(size) for size in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    if "embedding" not in names:
        seeds, seeds_note = None, "not used"
    elif args.cars196 is not None:
        seeds = cars196_seeds(args.cars196, args.cache_dir, rng)
        seeds_note = (
            f"{len(seeds):,} Cars196 images (all their views), pretrained EfficientNet-Lite0, "
            f"projected to {DIM}-d"
        )
    else:
        seeds = random_seed_images(RANDOM_SEED_IMAGES, RANDOM_SEED_CLASSES, DIM, rng)
        seeds_note = (
            f"{RANDOM_SEED_IMAGES:,} random images in {RANDOM_SEED_CLASSES} classes around random directions "
            "(no --cars196 given)"
        )
    meta = {
        "command": "python bench/index_bench.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, faiss "
        f"{faiss_module().__version__}",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "queries": args.queries,
        "target_recall": args.target_recall,
        "seeds": seeds_note,
        "growth_params": vars(CALIBRATED),
        "tuning_neighbourhood": tuning_module.NEIGHBOURHOOD,
    }
    began = time.perf_counter()
    rows, left_out, statistics = [], [], []
    held_out = args.queries + (MILVUS_TUNING_QUERIES if args.milvus_max else 0)
    # Real data comes at its own size (every extracted view); the synthetic sets at each of --sizes.
    plan = [("real", 0)] if "real" in names else []
    plan += [(name, count) for count in sizes for name in names if name != "real"]
    for name, count in plan:
        if name == "real":
            views, _ = real_embeddings(args.cars196, args.cache_dir, chunks=args.real_chunks)
            base, queries = real_split(views, held_out, rng)
            meta["real"] = {
                "images": views.shape[1],
                "views": views.shape[0],
                "of_images": len(cars196_files(args.cars196)),
            }
            del views
        elif name == "embedding":
            base, queries = embedding_like(count, held_out, seeds, rng)
        else:
            base, queries = uniform(count, held_out, DIM, rng)
        measured, missing, stats = run_size(name, base, queries, args)
        rows += measured
        left_out += missing
        statistics.append(stats)
        del base
    meta.update(
        wall_min=(time.perf_counter() - began) / 60, load_end=" ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    report = markdown(rows, left_out, statistics, meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        args.out.with_suffix(".json"),
        json.dumps({"meta": meta, "rows": rows, "left_out": left_out, "statistics": statistics}, indent=2),
    )
    atomic_write_text(args.out.with_suffix(".md"), report)
    print(report)


if __name__ == "__main__":
    main()
