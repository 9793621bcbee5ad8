"""Vector-index benchmark: every FAISS index type and Milvus Lite on embedding-like and uniform vectors.

    python bench/index_bench.py --sizes 100k            # a few minutes on 2 cores
    python bench/index_bench.py --sizes 100k,1M --milvus-max 100k --skip hnsw@uniform:1M   # about an hour

For each data set and size: build time (train + add + tuning), index size, query latency p50/p99 for
single queries and for batches of 64, and recall@10 against exact search on 1,000 held-out queries
(drawn like the data, never added to the index). Approximate FAISS indexes are tuned at build time to
reach recall@10 >= --target-recall on their own held-out sample (index/tuning.py: it stops short at a
quantisation ceiling or at searches slower than 20 ms a query); the table shows what they reach on the
benchmark's queries. All rows of one run share the machine, so their ratios compare. Rows left out
(--skip, Milvus above --milvus-max) are listed under the table with what the nearest measured row cost.

Data (dimension 512, unit vectors):
- ``embedding``: a mixture of many tight clusters on the sphere, ~100 vectors per cluster (cosine ~0.9
  to their centre), centres scattered (cosine ~0.8) around seed vectors. The seeds are real Cars196
  embeddings (the pretrained EfficientNet-Lite0, randomly projected from 1280 to 512 dimensions) with
  ``--cars196 IMAGES_DIR``, uniform random directions otherwise.
- ``uniform``: uniform random unit vectors, the worst case for every index (no structure to exploit).
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
from tqdm import tqdm

from index.atomic import atomic_write_text
from index.faiss_build import build_faiss_index
from index.faiss_index import faiss_module
from index.selection import IndexOptions, IndexSpec, choose_index, format_bytes, parse_size
from index.sources import ArraySource
from index.tuning import exact_neighbours, recall_at_k

DIM = 512
CLUSTER_SIZE = 100
MEMBER_COSINE = 0.9  # a vector to its cluster centre
CENTRE_COSINE = 0.8  # a cluster centre to its seed
K = 10
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


def unit(vectors: np.ndarray) -> np.ndarray:
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def around(points: np.ndarray, cosine: float, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at about ``cosine`` from each of ``points`` (isotropic noise of matching length)."""
    spread = np.sqrt(1.0 / cosine**2 - 1.0)
    noise = rng.standard_normal(points.shape).astype(np.float32) / np.sqrt(points.shape[1])
    return unit(points + spread * noise)


def cars196_seeds(count: int, dim: int, rng: np.random.Generator, images: Path) -> np.ndarray:
    """Pretrained embeddings of ``count`` Cars196 images, randomly projected to ``dim`` dimensions."""
    from engine.embedder import Embedder
    from engine.images import ImageDecodeError, load_image_file
    from training.features import backbone_model

    files = sorted(images.rglob("*.jpg"))
    chosen = [files[i] for i in rng.choice(len(files), size=count, replace=False)]
    with tempfile.TemporaryDirectory() as workdir:
        embedder = Embedder(backbone_model(Path(workdir), "efficientnet_lite0"))
        decoded = []
        for path in tqdm(chosen, desc="decoding Cars196 seeds", unit="img"):
            try:
                decoded.append(load_image_file(path, draft_size=embedder.card.preprocessing.resize_size))
            except (ImageDecodeError, OSError):
                continue  # the data set holds one truncated JPEG on purpose
        vectors = np.concatenate([embedder.embed(decoded[i : i + 32]) for i in range(0, len(decoded), 32)])
    projection, _ = np.linalg.qr(rng.standard_normal((vectors.shape[1], dim)))
    return unit(vectors @ projection)


def embedding_like(count: int, queries: int, seeds: np.ndarray, rng: np.random.Generator) -> tuple:
    centres = around(seeds[rng.integers(len(seeds), size=max(1, count // CLUSTER_SIZE))], CENTRE_COSINE, rng)
    base = around(centres[rng.integers(len(centres), size=count)], MEMBER_COSINE, rng)
    held_out = around(centres[rng.integers(len(centres), size=queries)], MEMBER_COSINE, rng)
    return base, held_out


def uniform(count: int, queries: int, dim: int, rng: np.random.Generator) -> tuple:
    return unit(rng.standard_normal((count, dim), dtype=np.float32)), unit(
        rng.standard_normal((queries, dim), dtype=np.float32)
    )


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
        backend = MilvusBackend.connect(Path(workdir), manifest)
        milvus_ids = []
        for start in tqdm(range(0, len(base), 5000), desc="inserting into Milvus Lite", unit="batch"):
            chunk = base[start : start + 5000]
            milvus_ids += backend.add(chunk, [(f"v{start + i}", None, "") for i in range(len(chunk))])
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
            spec=f"{manifest.index_type} (COSINE)",
            build_s=build_s,
            index_bytes=sum(p.stat().st_size for p in Path(workdir).rglob("*") if p.is_file()),
            search_params=backend.search_params,
            tuned_recall=tuned_recall,
        )
        backend.close()
    return row


def run_size(
    name: str, base: np.ndarray, held_out: np.ndarray, args: argparse.Namespace
) -> tuple[list[dict], list[dict]]:
    """The measured rows for one data set and size, and the rows left out (``--skip``, ``--milvus-max``)."""
    count = len(base)
    tqdm.write(f"{name} x {count}: exact ground truth")
    truth = exact_neighbours(held_out, [ArraySource(np.arange(count), base)], K)
    # The first queries measure every index; the rest tune Milvus (FAISS holds out its own at build time).
    queries, truth, tuning = (
        held_out[: args.queries],
        truth[: args.queries],
        (held_out[args.queries :], truth[args.queries :]),
    )
    rows, left_out = [], []
    budget = args.memory_budget
    # ivfpq gets the largest code that fits the budget; the others are what their type builds at this size.
    specs = [choose_index(count, DIM, IndexOptions(t, budget if t == "ivfpq" else None)) for t in args.types]
    auto = choose_index(count, DIM, IndexOptions())
    auto_budgeted = choose_index(count, DIM, IndexOptions(memory_budget=budget))
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
        row.update(data=name, count=count, dim=DIM)
        if exact is not None:
            row["speedup_single_vs_exact"] = exact["single"]["p50_ms"] / row["single"]["p50_ms"]
    return rows, left_out


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


def markdown(rows: list[dict], left_out: list[dict], meta: dict) -> str:
    lines = [
        "# Vector-index benchmark",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}; {meta['wall_min']:.0f} min wall time; "
        f"load average {meta['load']} at the start and {meta['load_end']} at the end (shared cores).",
        f"Recall@10 against exact search on {meta['queries']} held-out queries; FAISS indexes tuned to "
        f"recall@10 >= {meta['target_recall']} at build time. Latency in ms (single query; batch of 64).",
        f"Seeds of the embedding-like data: {meta['seeds']}. Milvus Lite's ef is tuned the same way on "
        f"{MILVUS_TUNING_QUERIES} other held-out queries. Size: the serialised FAISS index, Milvus Lite's "
        "files on disk. Build: train + add + tune. * after the params: tuning stopped short of the target "
        "(a quantisation ceiling, or searches slower than 20 ms a query).",
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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    parser.add_argument("--seed-images", type=int, default=600, help="Cars196 images embedded as seeds")
    parser.add_argument("--cars196", type=Path, help="Cars196 images folder for the embedding seeds")
    parser.add_argument("--out", type=Path, default=Path("bench/results/index_bench"))
    args = parser.parse_args()
    args.types = args.types.split(",")
    sizes = [count_of(size) for size in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    if "embedding" not in args.data:
        seeds, seeds_note = np.zeros((0, DIM), np.float32), "not used"
    elif args.cars196 is not None:
        seeds = cars196_seeds(args.seed_images, DIM, rng, args.cars196)
        seeds_note = f"{len(seeds)} Cars196 images, pretrained EfficientNet-Lite0, projected to {DIM}-d"
    else:
        seeds = unit(rng.standard_normal((args.seed_images, DIM)))
        seeds_note = f"{args.seed_images} uniform random directions (no --cars196 given)"
    meta = {
        "command": "python bench/index_bench.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, faiss "
        f"{faiss_module().__version__}",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "queries": args.queries,
        "target_recall": args.target_recall,
        "seeds": seeds_note,
    }
    began = time.perf_counter()
    rows, left_out = [], []
    for count in sizes:
        for name in args.data.split(","):
            if name == "embedding":
                base, queries = embedding_like(count, args.queries + MILVUS_TUNING_QUERIES, seeds, rng)
            else:
                base, queries = uniform(count, args.queries + MILVUS_TUNING_QUERIES, DIM, rng)
            measured, missing = run_size(name, base, queries, args)
            rows += measured
            left_out += missing
            del base
    meta.update(
        wall_min=(time.perf_counter() - began) / 60, load_end=" ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    report = markdown(rows, left_out, meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        args.out.with_suffix(".json"),
        json.dumps({"meta": meta, "rows": rows, "left_out": left_out}, indent=2),
    )
    atomic_write_text(args.out.with_suffix(".md"), report)
    print(report)


if __name__ == "__main__":
    main()
