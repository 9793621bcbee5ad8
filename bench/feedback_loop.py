"""The feedback loop with a simulated user (issue 40): refinement at once, and training on the judgments.

    python bench/feedback_loop.py --data ../shared/data/cars196 [--queries 50] [--seeds 0 1] \
        [--halves refinement learning] [--losses ms triplet ...] [--max-steps 1000]

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
The gain's 95% interval is a paired bootstrap over the queries.

The learning half: for each seed the same 50 queries' judgments (10 each, the top 10 of the index's own
vectors, judged by class, ``bench.lib.simulated_user``), kept with a copy of the index; at 0, 50, 100, 200
and 500 judgments (the first 0, 5, 10, 20 and 50 queries of the draw) a run trains on them alone
(``dmlsearch train --feedback INDEX`` with no data folder: ``training.feedback_rows``), in frozen mode (the
head on the cached backbone features; the recommended recipe of each loss, ``--max-steps`` and validation
every ``--eval-every`` steps on the validation judgments). It is scored on the gallery's *other* photos: the
ones no query of the seed's 50 searched or judged (about 7,700), among themselves by true class:
``recall@1`` and ``precision@10`` before (the pretrained model, what the index serves) and after (the run's
selected head). The run's gate (``training.feedback_gate``: held-out judgments, ranking precision, bootstrap)
is reported beside it, with whether it refused each run whose R@1 fell.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import closing
from pathlib import Path

import numpy as np
import torch
from lib.options import bench_parser, data_option, out_option, threads_option
from lib.simulated_user import judge_top

from engine.serve.query import ItemQuery, SearchOptions
from engine.serve.refine import Refinement, Strategy
from engine.serve.search import SearchService
from foundation import defaults
from index.gallery import GalleryIndex
from index.protocol import Entry
from index.selection import IndexOptions
from training.data import DataError
from training.features import FeatureExtractor
from training.feedback_gate import MIN_NEIGHBOURS_KEPT, UnjudgedCheck
from training.metrics import evaluate, nearest_neighbours
from training.model import build_objective
from training.recipes import resolve
from training.run_dir import RunDirectory
from training.trainer import train

RESULTS = Path(__file__).parent / "results"
JUDGED = 10  # the top results the simulated user judges, and the page size compared
BOOTSTRAP = 10_000
CURVE = (0, 50, 100, 200, 500)  # judgments trained on (learning half)


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


def scores(vectors: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Recall@1 and precision@10 of each photo among the others, by true class."""
    neighbours = nearest_neighbours(vectors, JUDGED)
    return {
        "recall@1": evaluate(vectors, labels, ks=(1,), clustering=False)["recall@1"],
        "precision@10": float((labels[neighbours] == labels[:, None]).mean()),
    }


def embed_with_run(run: Path, features: np.ndarray) -> np.ndarray:
    """The run's selected head on backbone features (frozen mode: what its exported model computes)."""
    directory = RunDirectory(run)
    objective = build_objective(directory.require_config(), features.shape[1])
    objective.load_state_dict(directory.require_best().objective)
    objective.eval()
    with torch.no_grad():
        return torch.cat([objective.embed(part) for part in torch.from_numpy(features).split(1024)]).numpy()


def class_folds(labels: dict[int, str], folds: int) -> list[set[str]]:
    """The classes cut into ``folds`` contiguous blocks, sorted by name (as bench/recipes_cv.py does), so a
    fold's makes are mostly unseen by the others' queries."""
    return [set(block) for block in np.array_split(np.array(sorted(set(labels.values()))), folds)]


def learning_seed(
    index: Path,
    features: dict[int, np.ndarray],
    labels: dict[int, str],
    seed: int,
    args,
    scratch: Path,
    fold: set[str] | None = None,
) -> list[dict]:
    """The learning half's rows of one seed: each loss at each point of the curve. With a ``fold`` of
    classes, the queries come from the other classes and the run is scored on the fold's photos alone."""
    items = sorted(labels)
    pool = [item for item in items if fold is None or labels[item] not in fold]
    drawn = [pool[i] for i in np.random.default_rng(seed).choice(len(pool), size=args.queries, replace=False)]
    every = scratch / f"seed{seed}-all"
    shutil.copytree(index, every)
    judge_top(every, drawn, JUDGED)
    with closing(GalleryIndex.open(every, read_only=True)) as judged:
        named = {j.result for j in judged.judgments.scan()} | set(drawn)
    shutil.rmtree(every)
    other = [  # never searched nor judged by this seed's user (and, with a fold, of the fold's classes)
        item for item in items if item not in named and (fold is None or labels[item] in fold)
    ]
    truth = np.array([labels[item] for item in other])
    base = np.stack([features[item] for item in other])
    before = scores(base, truth)
    where = {} if fold is None else {"fold": args.folds_named.index(fold)}
    rows = []
    for count in args.curve:
        if count == 0:
            rows.append(
                {
                    "seed": seed,
                    **where,
                    "strategy": "none",
                    "judgments": 0,
                    "others": len(other),
                    **_before_after(before, before),
                }
            )
            continue
        copy = scratch / f"seed{seed}-{count}"
        shutil.copytree(index, copy)
        judge_top(copy, drawn[: count // JUDGED], JUDGED)
        for loss in args.losses if count == max(args.curve) else args.losses[:1]:
            out = scratch / f"run-{seed}-{count}-{loss}"
            config = resolve(loss).config(
                loss,
                None,
                feedback=str(copy),
                cache_dir=str(defaults.CACHE_DIR),
                embedding_dim=args.embedding_dim,
                max_steps=args.max_steps,
                eval_every=args.eval_every,
                seed=seed,
            )
            started = time.perf_counter()
            row = {
                "seed": seed,
                **where,
                "strategy": f"train:{loss}",
                "judgments": count,
                "others": len(other),
                "command": args.command,
            }
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    summary = train(config, out, progress=False)
            except DataError as refused:
                rows.append({**row, "refused": str(refused)})
                print(json.dumps(rows[-1]), flush=True)
                continue
            after = scores(embed_with_run(out, base), truth)
            gate = summary.feedback
            assert gate is not None
            rows.append(
                {
                    **row,
                    **_before_after(before, after),
                    "steps": summary.steps,
                    "best_step": summary.best_step,
                    "train_seconds": summary.train_seconds,
                    "run_seconds": round(time.perf_counter() - started, 1),
                    "judgments_trained": gate.judgments_trained,
                    "judgments_validation": gate.judgments_validation,
                    "judgments_held_out": gate.judgments_held_out,
                    "gate_precision_before": gate.precision_before,
                    "gate_precision_after": gate.precision_after,
                    "gate_interval": [gate.interval.low, gate.interval.high],
                    "gate_judgments_better": gate.judgments_better,
                    "gate_passed": gate.passed,
                    "fixed": len(gate.fixed),
                    "broke": len(gate.broke),
                    **_unjudged_fields(gate.unjudged),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(out)
        shutil.rmtree(copy)
    return rows


def _unjudged_fields(check: UnjudgedCheck | None) -> dict:
    """The gate's label-free check of the unjudged photos, as a row's fields."""
    if check is None:
        return {}
    return {
        "unjudged_photos": check.photos,
        "unjudged_recall_before": check.recall_before,
        "unjudged_recall_after": check.recall_after,
        "unjudged_interval": [check.interval.low, check.interval.high],
        "unjudged_passed": check.passed,
        "unjudged_neighbours_kept": check.neighbours_kept,
    }


def _before_after(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        f"{name}_{when}": values[name]
        for name in before
        for when, values in (("before", before), ("after", after))
    }


def learning_half(data: Path, index: Path, args, scratch: Path) -> list[dict]:
    """Every seed's learning rows (see the module docstring)."""
    files, names = test_gallery(data)
    extracted = FeatureExtractor(defaults.CACHE_DIR, progress=False).extract(files)
    row_of = {file.relative_to(data).as_posix(): row for row, file in enumerate(files)}
    with closing(GalleryIndex.open(index, read_only=True)) as gallery:
        items = list(gallery.items.scan())
    features = {item.id: extracted.features[row_of[item.path]] for item in items}
    labels = {item.id: names[row_of[item.path]] for item in items}
    if not args.folds:
        return [
            row for seed in args.seeds for row in learning_seed(index, features, labels, seed, args, scratch)
        ]
    args.folds_named = class_folds(labels, args.folds)
    return [
        row
        for seed in args.seeds
        for fold in (args.fold if args.fold is not None else range(args.folds))
        for row in learning_seed(index, features, labels, seed, args, scratch, args.folds_named[fold])
    ]


def refinement_rows(service: SearchService, args) -> list[dict]:
    """The refinement half's rows: per seed and strategy, the means and the gain's interval."""
    rows = []
    for seed in args.seeds:
        for strategy, measured in run_seed(service, seed, args.queries).items():
            means = {name: float(values.mean()) for name, values in measured.items()}
            low, high = bootstrap_gain(measured["precision@10_before"], measured["precision@10_after"], seed)
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
    return rows


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("Cars196 folder: labels.csv and images/ (the committed results: ../shared/data/cars196)"),
        out_option(RESULTS / "feedback_loop", "results stem: STEM.json and STEM.md"),
        threads_option(2, "onnxruntime threads of the query embedding"),
    )
    parser.add_argument("--queries", type=int, default=50, help="queries per seed (10 judgments each)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the query draw")
    parser.add_argument(
        "--halves", nargs="+", choices=("refinement", "learning"), default=["refinement", "learning"]
    )
    parser.add_argument(
        "--losses", nargs="+", default=["ms"], help="learning: the first draws the curve, all train at 500"
    )
    parser.add_argument("--curve", type=int, nargs="+", default=list(CURVE), help="learning: judgments")
    parser.add_argument(
        "--embedding-dim",
        type=int,
        default=1280,
        help="learning: the head's output; the backbone's 1280 makes the untrained head a rotation of the "
        "features, so step 0 ranks as the served pretrained model does",
    )
    parser.add_argument(
        "--learning-rows",
        type=Path,
        nargs="+",
        help="learning: report the rows these files hold (JSON lines, as a run prints them) instead of "
        "training",
    )
    parser.add_argument(
        "--folds",
        type=int,
        default=0,
        help="learning: cross-validate over this many class folds (0: none); for each fold the queries come "
        "from the other classes and the runs are scored on the fold's photos; the losses are ranked",
    )
    parser.add_argument("--fold", type=int, nargs="+", help="learning: only these folds of --folds")
    parser.add_argument("--max-steps", type=int, default=1000, help="learning: steps per run at most")
    parser.add_argument("--eval-every", type=int, default=25, help="learning: steps between validations")
    args = parser.parse_args()
    args.command = "python bench/feedback_loop.py " + " ".join(sys.argv[1:])
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    saved = args.out.with_suffix(".json")
    previous = json.loads(saved.read_text()) if saved.exists() else None
    refine = "refinement" in args.halves
    rows, learning = [], []
    if args.learning_rows:  # rows printed by runs of this script, one seed each
        lines = [line for file in args.learning_rows for line in file.read_text().splitlines()]
        learning = [json.loads(line) for line in lines if line.startswith('{"seed"')]
    if refine or ("learning" in args.halves and not args.learning_rows):
        with tempfile.TemporaryDirectory() as scratch:
            model, count, classes = build_gallery_index(args.data.resolve(), Path(scratch) / "index")
            gallery = {"data": "Cars196 test classes (dml_split=test)", "classes": classes, "items": count}
            if "learning" in args.halves and not args.learning_rows:
                learning = learning_half(args.data.resolve(), Path(scratch) / "index", args, Path(scratch))
            if refine:
                service = SearchService.open(model, Path(scratch) / "index", threads=args.threads)
                rows = refinement_rows(service, args)
                service.close()
    else:
        gallery = None if previous is None else previous["gallery"]  # rows alone: no refinement half
    refinement = {"command": args.command, "seconds": time.perf_counter() - started}
    if not refine and previous is not None:  # the half not run now keeps its results
        rows, refinement = previous["rows"], {"command": previous["command"], "seconds": previous["seconds"]}
    result = {
        "gallery": gallery,
        "command": refinement["command"],
        "model": "pretrained EfficientNet-Lite0, exported (training.features.backbone_model)",
        "index": "FAISS flat",
        "goal_points": 15,
        "rows": rows,
        "learning": {
            "goal_points": 5,
            "settings": {
                "mode": "frozen (the head on cached backbone features)",
                "recipe": "recommended",
                "losses": args.losses,
                "embedding_dim": args.embedding_dim,
                "max_steps": args.max_steps,
                "eval_every": args.eval_every,
                "threads": args.threads,
                "folds": args.folds,
            },
            "rows": learning,
            "cross_validation": cross_validation(learning),
            "commands": sorted({row.get("command", args.command) for row in learning}),
        },
        "seconds": refinement["seconds"],
    }
    out = args.out
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(report(result))
    print(report(result))


def report(result: dict) -> str:
    lines = ["# Feedback loop: refinement at once (issue 40)", "", *refinement_report(result)]
    lines += [
        *learning_report(result["learning"]),
        f"Command: `{result['command']}` ({result['seconds']:.0f} s).",
        "",
    ]
    return "\n".join(lines)


def refinement_report(result: dict) -> list[str]:
    if not result["rows"]:
        return ["The refinement half was not run for these results (bench/results/feedback_loop.md).", ""]
    lines = [
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
    return [
        *lines,
        "",
        "R@1 here is the first photo of each compared page (rank 11 against the refined page's first), not "
        "the learning half's R@1 on photos never judged (below).",
        "",
    ]


def learning_report(learning: dict) -> list[str]:
    """The learning half's table: R@1 and P@10 on the photos never searched nor judged, and the gate."""
    if not learning["rows"]:
        return []
    settings = learning["settings"]
    lines = [
        "## Learning: training on the judgments",
        "",
        f"Runs on the judgments alone, {settings['mode']}, a {settings['embedding_dim']}-d head, the "
        f"{settings['recipe']} recipe of each loss, at "
        f"most {settings['max_steps']} steps, validated every {settings['eval_every']} steps on the "
        f"validation judgments, {settings['threads']} threads. Scored on the gallery's photos that no "
        "query of the seed searched or judged, among themselves by true class. "
        f"Goal: +{learning['goal_points']} R@1. "
        "Gate: ranking precision of the held-out judgments (👍 above 👎), trained vs served, 95% bootstrap "
        "interval over the held-out queries; `passed` means the run may be exported.",
        "",
        "| seed | run | judgments (trained/val/held out) | others | R@1 before | R@1 after | gain | "
        "P@10 before | P@10 after | steps (best) | gate: precision before -> after (95% CI of gain) | "
        "gate | fixed / broke | R@1 fell, gate refused | unjudged: view R@1 before -> after (95% CI), "
        "neighbours kept | gate with the unjudged check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in learning["rows"]:
        if "refused" in row:
            lines.append(
                f"| {row['seed']} | {row['strategy']} | {row['judgments']} | {row['others']} | "
                f"refused: {row['refused']} |||||||||"
            )
            continue
        gain = 100 * (row["recall@1_after"] - row["recall@1_before"])
        head = (
            f"| {row['seed']} | {row['strategy']} | {row['judgments']} | {row['others']} | "
            f"{100 * row['recall@1_before']:.2f} | {100 * row['recall@1_after']:.2f} | {gain:+.2f} | "
            f"{100 * row['precision@10_before']:.2f} | {100 * row['precision@10_after']:.2f} |"
        )
        if "gate_passed" not in row:
            lines.append(head + " - | - | - | - | - | - | - |")
            continue
        low, high = row["gate_interval"]
        head = head.replace(
            f"| {row['judgments']} |",
            f"| {row['judgments']} ({row['judgments_trained']}/{row['judgments_validation']}/"
            f"{row['judgments_held_out']}) |",
            1,
        )
        fell = row["recall@1_after"] < row["recall@1_before"]
        lines.append(
            head + f" {row['steps']} ({row['best_step']}) | {100 * row['gate_precision_before']:.1f} -> "
            f"{100 * row['gate_precision_after']:.1f} ({100 * low:+.1f} to {100 * high:+.1f}) | "
            f"{'passed' if judgments_gate(row) else 'refused'} | {row['fixed']} / {row['broke']} | "
            f"{('yes, ' + ('yes' if not judgments_gate(row) else 'NO')) if fell else 'no'} | "
            f"{_unjudged_cell(row)} | {_verdict(unjudged_gate(row))} |"
        )
    commands = "; ".join(f"`{command}`" for command in learning["commands"])
    return [
        *lines,
        "",
        *gate_report(learning["rows"]),
        *cross_validation_report(learning["rows"]),
        f"Learning half: {commands}.",
        "",
    ]


def judgments_gate(row: dict) -> bool:
    """The gate on the held-out judgments alone (before the unjudged check; rows without its field come
    from then)."""
    return row.get("gate_judgments_better", row["gate_passed"])


def unjudged_gate(row: dict) -> bool | None:
    """The gate with the unjudged photos' check (training.feedback_gate), replayed from the row's figures
    with today's rule; None for a row without them."""
    if "unjudged_interval" not in row:
        return None
    not_worse = row["unjudged_interval"][1] >= 0
    return judgments_gate(row) and not_worse and row["unjudged_neighbours_kept"] >= MIN_NEIGHBOURS_KEPT


def _verdict(passed: bool | None) -> str:
    return "-" if passed is None else "passed" if passed else "refused"


def _unjudged_cell(row: dict) -> str:
    if "unjudged_interval" not in row:
        return "-"
    low, high = row["unjudged_interval"]
    return (
        f"{100 * row['unjudged_recall_before']:.1f} -> {100 * row['unjudged_recall_after']:.1f} "
        f"({100 * low:+.1f} to {100 * high:+.1f}), {row['unjudged_neighbours_kept']:.2f}"
    )


def gate_report(rows: list[dict]) -> list[str]:
    """How many runs each gate lets through, and how many of those lost R@1 on the unjudged classes."""
    scored = [row for row in rows if unjudged_gate(row) is not None]
    if not scored:
        return []
    lines = [
        "## The gate against R@1 on the classes nobody judged",
        "",
        f"Runs with the unjudged photos' check: {len(scored)}. `passed`: the gate lets it be served; "
        "`fell`: its R@1 on the fold's photos (never judged) fell. The check: the label-free view Recall@1 "
        f"of up to 500 unjudged photos not worse (95% CI), and at least {MIN_NEIGHBOURS_KEPT:.2f} of their "
        "10 nearest unjudged photos kept on average (training/feedback_gate.py).",
        "",
        "| gate | passed | of which R@1 fell | fell by |",
        "|---|---|---|---|",
    ]
    for name, rule in (
        ("held-out judgments only", judgments_gate),
        ("with the unjudged check", unjudged_gate),
    ):
        passed = [row for row in scored if rule(row)]
        falls = [100 * (row["recall@1_before"] - row["recall@1_after"]) for row in passed]
        fell = sorted(fall for fall in falls if fall > 0)
        span = f"{fell[0]:.2f}-{fell[-1]:.2f}" if fell else "-"
        lines.append(f"| {name} | {len(passed)} | {len(fell)} | {span} |")
    return [*lines, ""]


def cross_validation(rows: list[dict]) -> dict[str, dict]:
    """Per loss, over the (seed, fold) cells of the rows that have a fold: the R@1 gain of each cell, its
    mean, worst, rank in each cell (1: best gain there) and how often the gate passed; best mean first."""
    trained = [row for row in rows if "fold" in row and "gate_passed" in row]
    cells = sorted({(row["seed"], row["fold"]) for row in trained})
    gains: dict[str, dict[tuple[int, int], float]] = {}
    passed: dict[str, int] = {}
    for row in trained:
        loss = row["strategy"].removeprefix("train:")
        gains.setdefault(loss, {})[(row["seed"], row["fold"])] = 100 * (
            row["recall@1_after"] - row["recall@1_before"]
        )
        passed[loss] = passed.get(loss, 0) + row["gate_passed"]
    complete = {loss: cell for loss, cell in gains.items() if set(cell) == set(cells)}
    ranks = {
        loss: [1 + sum(other[c] > complete[loss][c] for other in complete.values()) for c in cells]
        for loss in complete
    }
    table = {
        loss: {
            "cells": [{"seed": s, "fold": f, "gain": complete[loss][(s, f)]} for s, f in cells],
            "mean_gain": float(np.mean([complete[loss][c] for c in cells])),
            "worst_gain": min(complete[loss][c] for c in cells),
            "ranks": ranks[loss],
            "gate_passed": passed[loss],
        }
        for loss in complete
    }
    return dict(sorted(table.items(), key=lambda item: (-item[1]["mean_gain"], -item[1]["worst_gain"])))


def cross_validation_report(rows: list[dict]) -> list[str]:
    table = cross_validation(rows)
    if len(table) < 2:  # one loss run in every cell: nothing to choose between
        return []
    cells = next(iter(table.values()))["cells"]
    names = " | ".join(f"seed {c['seed']} fold {c['fold']}" for c in cells)
    lines = [
        "## Which loss: cross-validation over class folds",
        "",
        "R@1 gain (points) on each fold's photos, from the judgments of queries of the other classes; the "
        "rank of the loss in each cell in brackets (1: best there). Best mean gain first, the worst cell "
        "breaking ties.",
        "",
        f"| loss | {names} | mean | worst | gate passed |",
        "|---|" + "---|" * (len(cells) + 3),
    ]
    for loss, row in table.items():
        gains = " | ".join(
            f"{cell['gain']:+.2f} ({rank})" for cell, rank in zip(row["cells"], row["ranks"], strict=True)
        )
        lines.append(
            f"| {loss} | {gains} | {row['mean_gain']:+.2f} | {row['worst_gain']:+.2f} | "
            f"{row['gate_passed']}/{len(cells)} |"
        )
    return [*lines, "", f"Recommended for `dmlsearch train --feedback`: **{next(iter(table))}**.", ""]


if __name__ == "__main__":
    main()
