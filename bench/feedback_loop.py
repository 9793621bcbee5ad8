"""The feedback loop with a simulated user (issue 40): refinement at once, through the search service.

    python bench/feedback_loop.py --data ../shared/data/cars196 [--queries 50] [--seeds 0 1]

The gallery is Cars196's 98 test classes (``dml_split=test`` of ``labels.csv``, 8,131 photos), embedded by
the pretrained EfficientNet-Lite0 as exported (``training.features``' cached backbone model, the model
``make demo`` serves) into a flat FAISS index whose gallery is ``--data``. For each seed, ``--queries``
gallery photos are drawn as queries and each is searched by item, as ``GET /v1/items/{id}/similar`` does
(``QueryService`` with an ``ItemQuery``: its image decoded and embedded again, the item left out), for 20
results. The simulated user marks the top 10 by the true class (👍 same car model, 👎 another): 10
judgments a query. The query is then searched again refined by those judgments, with each strategy of
``engine.serve.refine``, for 10 results; the judged items and the query are left out, so the refined page
shows only results the user has not judged yet.

- ``precision@10_before``: the share of the query's class among the plain search's next page (ranks
  11-20), what the user would have seen next without judging; ``precision@10_after``: the same share among
  the refined page. Both pages hold only unjudged photos.
- ``recall@1_before`` / ``_after``: whether the first photo of each of those pages is of the query's
  class (the share of queries where it is).
The gain's 95% interval is a paired bootstrap over the queries. The learning half of the loop (training on
the judgments) is issue 40's part 3 and is not measured here.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from lib.options import bench_parser, data_option, out_option, threads_option

from engine.serve.query import ItemQuery, SearchOptions
from engine.serve.refine import Refinement, Strategy
from engine.serve.search import SearchService
from foundation import defaults
from index.gallery import GalleryIndex
from index.protocol import Entry
from index.selection import IndexOptions
from training.features import FeatureExtractor

RESULTS = Path(__file__).parent / "results"
JUDGED = 10  # the top results the simulated user judges, and the page size compared
BOOTSTRAP = 10_000


def test_gallery(data: Path) -> tuple[list[Path], list[str]]:
    """The test classes' photos (sorted by path, the features cache's key) and their class names."""
    with (data / "labels.csv").open(newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["dml_split"] == "test"]
    rows.sort(key=lambda row: row["path"])
    return [data / row["path"] for row in rows], [row["class_name"] for row in rows]


def build_gallery_index(data: Path, directory: Path) -> tuple[Path, int, int]:
    """The flat index of the test gallery's pretrained embeddings; returns the model, the item count and the
    class count."""
    files, labels = test_gallery(data)
    extractor = FeatureExtractor(defaults.CACHE_DIR)
    features = extractor.extract(files)
    index = GalleryIndex.create(
        directory,
        dim=features.features.shape[1],
        model_fingerprint=extractor.embedder.fingerprint,
        gallery_root=data,
        options=IndexOptions("flat"),
    )
    kept = np.flatnonzero(features.ok)
    entries = [
        Entry(str(files[i].relative_to(data)), labels[i], hashlib.sha256(files[i].read_bytes()).hexdigest())
        for i in kept
    ]
    index.add(features.features[kept], entries)
    index.save()
    index.close()
    return extractor.embedder.model_path, len(kept), len({labels[i] for i in kept})


def run_seed(service: SearchService, seed: int, queries: int) -> dict[str, dict[str, np.ndarray]]:
    """Per strategy: each query's precision@10 and recall@1 before and after refining."""
    items, _ = service.reader.page(0, len(service.index))
    rng = np.random.default_rng(seed)
    drawn = [items[i] for i in rng.choice(len(items), size=queries, replace=False)]
    scores: dict[str, dict[str, list[float]]] = {s.value: {} for s in Strategy}
    for item in drawn:
        query = [ItemQuery(item.id)]
        plain = service.queries.search(query, SearchOptions(k=2 * JUDGED)).queries[0].results
        top, following = plain[:JUDGED], plain[JUDGED : 2 * JUDGED]
        positive = tuple(r.id for r in top if r.label == item.label)
        negative = tuple(r.id for r in top if r.label != item.label)
        for strategy in Strategy:
            refine = Refinement(positive, negative, strategy)
            found = service.queries.search(query, SearchOptions(k=JUDGED, refine=refine)).queries[0].results
            assert not {r.id for r in found} & {*positive, *negative, item.id}  # only unjudged photos
            row = scores[strategy.value]
            for name, page in (("before", following), ("after", found)):
                row.setdefault(f"precision@10_{name}", []).append(_share(page, item.label))
                row.setdefault(f"recall@1_{name}", []).append(
                    float(bool(page) and page[0].label == item.label)
                )
    return {s: {name: np.array(values) for name, values in row.items()} for s, row in scores.items()}


def _share(page: list, label: str | None) -> float:
    return sum(result.label == label for result in page) / JUDGED


def bootstrap_gain(before: np.ndarray, after: np.ndarray, seed: int) -> tuple[float, float]:
    """The 95% interval of mean(after - before), resampling the queries (paired)."""
    gains = after - before
    rng = np.random.default_rng(seed)
    means = gains[rng.integers(len(gains), size=(BOOTSTRAP, len(gains)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("Cars196 folder: labels.csv and images/ (the committed results: ../shared/data/cars196)"),
        out_option(RESULTS / "feedback_loop", "results stem: STEM.json and STEM.md"),
        threads_option(2, "onnxruntime threads of the query embedding"),
    )
    parser.add_argument("--queries", type=int, default=50, help="queries per seed (10 judgments each)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the query draw")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        model, count, classes = build_gallery_index(args.data.resolve(), Path(scratch) / "index")
        service = SearchService.open(model, Path(scratch) / "index", threads=args.threads)
        rows = []
        for seed in args.seeds:
            for strategy, measured in run_seed(service, seed, args.queries).items():
                means = {name: float(values.mean()) for name, values in measured.items()}
                low, high = bootstrap_gain(
                    measured["precision@10_before"], measured["precision@10_after"], seed
                )
                rows.append(
                    {
                        "seed": seed,
                        "strategy": strategy,
                        "queries": args.queries,
                        "judgments": args.queries * JUDGED,
                        **means,
                        "gain_points": 100 * (means["precision@10_after"] - means["precision@10_before"]),
                        "gain_points_95ci": [100 * low, 100 * high],
                    }
                )
        service.close()
    result = {
        "gallery": {"data": "Cars196 test classes (dml_split=test)", "classes": classes, "items": count},
        "command": "python bench/feedback_loop.py " + " ".join(sys.argv[1:]),
        "model": "pretrained EfficientNet-Lite0, exported (training.features.backbone_model)",
        "index": "FAISS flat",
        "goal_points": 15,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    out = args.out
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(report(result))
    print(report(result))


def report(result: dict) -> str:
    lines = [
        "# Feedback loop: refinement at once (issue 40)",
        "",
        f"Gallery: {result['gallery']['data']}, {result['gallery']['items']} photos, "
        f"{result['gallery']['classes']} classes; {result['model']}; {result['index']}. A simulated user "
        f"judges each query's top {JUDGED} by the true class; the refined page (only unjudged photos) is "
        f"compared with the plain search's ranks {JUDGED + 1}-{2 * JUDGED}. Goal: +{result['goal_points']} "
        "points of precision@10.",
        "",
        "| seed | strategy | queries | judgments | P@10 before (ranks 11-20) | P@10 after (refined) "
        "| gain, points (95% CI) | R@1 before | R@1 after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        low, high = row["gain_points_95ci"]
        lines.append(
            f"| {row['seed']} | {row['strategy']} | {row['queries']} | {row['judgments']} | "
            f"{row['precision@10_before']:.3f} | {row['precision@10_after']:.3f} | "
            f"{row['gain_points']:+.1f} ({low:+.1f} to {high:+.1f}) | {row['recall@1_before']:.2f} | "
            f"{row['recall@1_after']:.2f} |"
        )
    lines += [
        "",
        "R@1 here is the first photo of each compared page (rank 11 against the refined page's first), not "
        "the learning half's R@1 on photos never judged (issue 40, part 3: not measured here).",
        "",
        f"Command: `{result['command']}` ({result['seconds']:.0f} s).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
