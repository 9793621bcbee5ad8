"""``dmlsearch report RUN``: one self-contained HTML page of pictures that show what training changed.

The page (``RUN/report.html``) embeds every plot as a base64 PNG and needs no network; the same PNGs are
written under ``RUN/report/`` so the API can serve them to the UI's Model page. Plots are matplotlib
figures (the object API, no pyplot state, so reports can be drawn from any thread):

* training loss and validation Recall@1 against step, with the selected checkpoint marked;
* Recall@K, trained vs the untrained backbone, on the test images;
* per-class Recall@1 change;
* a 2-D t-SNE map of the test embeddings of both models, coloured by class;
* example queries whose top-1 the training fixed, and some it broke, with thumbnails;
* a run without labels: how its pseudo-labels evolved (clusters at each refresh and their sizes), on the
  page only (the UI's Model page shows the plots every run has).
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.typing import ColorType
from sklearn.decomposition import PCA
from sklearn.manifold import TSNE

from engine.decode.images import load_image_file
from engine.model.run_proof import PLOTS, REPORT_FILE, plot_path
from foundation.atomic import atomic_path, atomic_write_text
from training.comparison import Comparison, serving_check
from training.evaluation import RunEmbeddings
from training.metrics import TopHits, retrieval_metrics, top_hits
from training.run_dir import LabelFreeRecord, RunDirectory
from training.trainer import SELECTION_METRIC, mostly_zero_loss

CURVE_KS = (1, 2, 4, 8, 16, 32)
TABLE_METRICS = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi", "f1")
MAP_POINTS = 2000  # t-SNE cost grows with the points: a seeded sample of the test images beyond this
# The t-SNE map names this many classes in its legend, those with the most points; the rest are "other".
LEGEND_CLASSES = 10
OTHER_COLOUR = "lightgray"
EXAMPLES = 5  # fixed and broken queries shown each
THUMBNAIL = 160
TRAINED_COLOUR, UNTRAINED_COLOUR = "tab:blue", "tab:gray"
PSEUDO_LABEL_CAPTION = (
    "Trained without labels: the pseudo-labels' k-means clusters at each refresh (left) and how many photos "
    "each held (right)."
)


@dataclass(frozen=True)
class Report:
    html_path: Path
    plots: dict[str, Path]


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def training_figure(records: Sequence[dict[str, Any]], best_step: int) -> Figure:
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    loss_axes, recall_axes = figure.subplots(1, 2)
    trained = [record for record in records if record.get("train_loss") is not None]
    loss_axes.plot(
        [r["step"] for r in trained], [r["train_loss"] for r in trained], marker=".", color="tab:red"
    )
    loss_axes.set(title="training loss", xlabel="step", ylabel="mean loss since the last validation")
    steps = [r["step"] for r in records]
    recall = [100 * r["val"][SELECTION_METRIC] for r in records]
    recall_axes.plot(steps, recall, marker=".", color=TRAINED_COLOUR, label="trained (validation)")
    if "val_backbone" in records[0]:
        untrained = 100 * records[0]["val_backbone"][SELECTION_METRIC]
        recall_axes.axhline(untrained, color=UNTRAINED_COLOUR, linestyle="--", label="untrained backbone")
    best = next(r for r in records if r["step"] == best_step)
    recall_axes.plot(
        [best_step], [100 * best["val"][SELECTION_METRIC]], marker="*", markersize=16, color="gold",
        markeredgecolor="black", linestyle="none", label=f"selected checkpoint (step {best_step})",
    )  # fmt: skip
    recall_axes.set(title="validation Recall@1", xlabel="step", ylabel="Recall@1 (%)")
    recall_axes.legend(loc="best")  # the curve may sit anywhere relative to the untrained line
    for axes in (loss_axes, recall_axes):
        axes.grid(alpha=0.3)
    return figure


def pseudo_label_figure(record: LabelFreeRecord) -> Figure:
    """Clusters at each pseudo-label refresh of a run without labels, and the spread of their sizes."""
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    count_axes, size_axes = figure.subplots(1, 2)
    steps = [refresh.step for refresh in record.refreshes]
    count_axes.plot(steps, [refresh.clusters for refresh in record.refreshes], marker="o", color="tab:purple")
    count_axes.set(title="k-means clusters (pseudo-classes)", xlabel="refresh at step", ylabel="clusters")
    size_axes.boxplot([refresh.sizes for refresh in record.refreshes], positions=range(len(steps)))
    size_axes.set_xticks(range(len(steps)), [str(step) for step in steps])
    size_axes.set(title="photos per cluster", xlabel="refresh at step", ylabel="photos")
    for axes in (count_axes, size_axes):
        axes.grid(alpha=0.3)
    return figure


def recall_figure(embedded: RunEmbeddings) -> Figure:
    ks = [k for k in CURVE_KS if k < len(embedded.labels)]
    figure = Figure(figsize=(6.5, 4.2), layout="constrained")
    axes = figure.subplots()
    curves = {}
    for name, vectors, colour in (
        ("untrained backbone", embedded.untrained, UNTRAINED_COLOUR),
        ("trained", embedded.trained, TRAINED_COLOUR),
    ):
        metrics = retrieval_metrics(vectors, embedded.labels, ks)
        curves[colour] = [100 * metrics[f"recall@{k}"] for k in ks]
        axes.plot(ks, curves[colour], marker="o", color=colour, label=name)
    # At each K the higher value is written above its point and the lower one below (the trained one
    # above on a tie), so close curves never print one number over the other or across a line.
    for position, k in enumerate(ks):
        trained, untrained = curves[TRAINED_COLOUR][position], curves[UNTRAINED_COLOUR][position]
        for colour, value, above in (
            (TRAINED_COLOUR, trained, trained >= untrained),
            (UNTRAINED_COLOUR, untrained, untrained > trained),
        ):
            axes.annotate(
                f"{value:.1f}", (k, value), textcoords="offset points", xytext=(0, 6 if above else -6),
                ha="center", va="bottom" if above else "top", fontsize=8, color=colour,
            )  # fmt: skip
    axes.margins(y=0.12)  # room for the labels above the highest point and below the lowest
    axes.set_xscale("log", base=2)
    axes.set_xticks(ks, [str(k) for k in ks])
    axes.set(title="Recall@K on the test images", xlabel="K", ylabel="Recall@K (%)")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    return figure


def per_class_change(embedded: RunEmbeddings, trained: TopHits, untrained: TopHits) -> dict[str, float]:
    """Recall@1 change in points per test class (both hit lists cover the same answerable queries)."""
    labels = embedded.labels[trained.queries]
    return {
        embedded.class_names[label]: 100
        * float(trained.hit[labels == label].mean() - untrained.hit[labels == label].mean())
        for label in np.unique(labels)
    }


def per_class_figure(change: dict[str, float]) -> Figure:
    names = sorted(change, key=change.__getitem__)
    values = np.array([change[name] for name in names])
    labelled = len(names) <= 40  # beyond that, names would overlap: the sorted profile tells the story
    figure = Figure(figsize=(11, 4.6 if labelled else 3.8), layout="constrained")
    axes = figure.subplots()
    colours = np.where(values > 0, "tab:green", np.where(values < 0, "tab:red", "lightgray"))
    axes.bar(np.arange(len(names)), values, color=colours)
    axes.axhline(0, color="black", linewidth=0.8)
    if labelled:
        axes.set_xticks(np.arange(len(names)), names, rotation=60, ha="right", fontsize=8)
    else:
        axes.set_xticks([])
        axes.set_xlabel(f"{len(names)} test classes, sorted by change")
    better, worse = int((values > 0).sum()), int((values < 0).sum())
    axes.set(ylabel="Recall@1 change (points)")
    axes.set_title(
        f"per-class Recall@1 change: {better} classes improved, {worse} worsened, "
        f"{len(names) - better - worse} unchanged"
    )
    axes.grid(axis="y", alpha=0.3)
    return figure


def _map_coordinates(vectors: np.ndarray, seed: int) -> np.ndarray:
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    reduced = PCA(n_components=min(50, *unit.shape), random_state=seed).fit_transform(unit)
    perplexity = min(30.0, (len(unit) - 1) / 3)
    return TSNE(perplexity=perplexity, init="pca", random_state=seed).fit_transform(reduced)


def embedding_figure(embedded: RunEmbeddings, seed: int = 0) -> Figure:
    rows = np.arange(len(embedded.labels))
    if len(rows) > MAP_POINTS:
        rows = np.sort(np.random.default_rng(seed).choice(rows, MAP_POINTS, replace=False))
    labels = embedded.labels[rows]
    classes = np.unique(labels)
    colours, named, legend = _map_colours(labels, embedded.class_names)
    order = np.argsort(named, kind="stable")  # the grey "other" points first, beneath the named ones
    figure = Figure(figsize=(13, 5.2), layout="constrained")
    for axes, (name, vectors) in zip(
        figure.subplots(1, 2),
        (("untrained backbone", embedded.untrained), ("trained", embedded.trained)),
        strict=True,
    ):
        points = _map_coordinates(vectors[rows], seed)[order]
        size = 9 if len(rows) > 500 else 30  # small maps: bigger dots
        axes.scatter(points[:, 0], points[:, 1], c=colours[order], s=size, alpha=0.8, linewidths=0)
        axes.set_title(f"{name}: {len(rows)} test images, {len(classes)} classes")
        axes.set_xticks([])
        axes.set_yticks([])
    figure.legend(handles=legend, loc="outside right upper", title="class", fontsize="small")
    return figure


def _map_colours(labels: np.ndarray, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[Line2D]]:
    """Each point's colour, whether its class is named, and the map's legend: the ``LEGEND_CLASSES``
    classes with the most points each in a colour of its own, every other class grey (a colour per class
    repeats past 20 classes, and a legend of 98 names cannot be read)."""
    classes, counts = np.unique(labels, return_counts=True)
    top = classes[np.argsort(-counts, kind="stable")[:LEGEND_CLASSES]]
    colours = np.tile(to_rgba(OTHER_COLOUR), (len(labels), 1))
    legend = []
    palette = colormaps["tab10"]
    for colour, label in zip(map(palette, range(palette.N)), top, strict=False):
        colours[labels == label] = colour
        legend.append(_dot(colour, names[label]))
    if len(classes) > len(top):
        legend.append(_dot(OTHER_COLOUR, f"other ({len(classes) - len(top)} classes)"))
    return colours, np.isin(labels, top), legend


def _dot(colour: ColorType, label: str) -> Line2D:
    return Line2D([], [], marker="o", linestyle="", color=colour, label=label)


def _thumbnail(path: Path) -> np.ndarray:
    image = load_image_file(path, draft_size=THUMBNAIL)
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    return np.asarray(image.convert("RGB"))


def _example_rows(
    trained: TopHits, untrained: TopHits, count: int, seed: int
) -> list[tuple[str, int, int, int]]:
    """(kind, query, untrained top-1, trained top-1) for up to ``count`` fixed and ``count`` broken queries,
    a seeded random choice among them (the first ones would all come from the first classes)."""
    rng = np.random.default_rng(seed)
    rows = []
    for kind, chosen in (("fixed", trained.hit & ~untrained.hit), ("broken", ~trained.hit & untrained.hit)):
        candidates = np.flatnonzero(chosen)
        for position in np.sort(rng.choice(candidates, min(count, len(candidates)), replace=False)):
            rows.append((kind, trained.queries[position], untrained.top1[position], trained.top1[position]))
    return rows


def examples_figure(embedded: RunEmbeddings, trained: TopHits, untrained: TopHits, seed: int = 0) -> Figure:
    rows = _example_rows(trained, untrained, EXAMPLES, seed)
    figure = Figure(figsize=(7.5, 2.3 * max(len(rows), 1)), layout="constrained")
    if not rows:
        axes = figure.subplots()
        axes.axis("off")
        axes.text(0.5, 0.5, "no query changed its top-1 class", ha="center", va="center")
        return figure
    grid = np.atleast_2d(figure.subplots(len(rows), 3))
    names = embedded.class_names
    for axes_row, (kind, query, before, after) in zip(grid, rows, strict=True):
        true_class = embedded.labels[query]
        for axes, row, title in (
            (axes_row[0], query, f"{kind}: query\n{names[true_class]}"),
            (axes_row[1], before, f"untrained top-1\n{names[embedded.labels[before]]}"),
            (axes_row[2], after, f"trained top-1\n{names[embedded.labels[after]]}"),
        ):
            axes.imshow(_thumbnail(embedded.files[row]))
            axes.set_xticks([])
            axes.set_yticks([])
            correct = row == query or embedded.labels[row] == true_class
            colour = "black" if row == query else ("tab:green" if correct else "tab:red")
            axes.set_title(title, fontsize=8, color=colour)
            for spine in axes.spines.values():
                spine.set(color=colour, linewidth=1 if row == query else 3)
    return figure


def _metrics_table(comparison: Comparison) -> str:
    names = TABLE_METRICS
    header = "".join(f"<th>{html.escape(name.upper())}</th>" for name in names)
    rows = []
    for label, metrics in (("untrained backbone", comparison.untrained), ("trained", comparison.trained)):
        cells = "".join(f"<td>{100 * metrics[name]:.2f}</td>" for name in names)
        rows.append(f"<tr><th>{label}</th>{cells}</tr>")
    if comparison.knc is not None:
        knc = comparison.knc
        rows.append(
            f"<tr><th>kNC accuracy (Magnet Eq. 6)</th><td colspan='{len(names)}'>trained "
            f"{100 * knc['trained']:.2f}, untrained {100 * knc['untrained']:.2f}</td></tr>"
        )
    return f"<table><tr><th></th>{header}</tr>{''.join(rows)}</table>"


def _summary_html(run_path: Path, comparison: Comparison, embedded: RunEmbeddings) -> str:
    config = embedded.config
    interval = comparison.recall_at_1
    summary = RunDirectory(run_path).read_summary()
    selected = "step ? of ?" if summary is None else f"step {summary.best_step} of {summary.steps}"
    recipe = (config.recipe or {}).get("name", "-")
    facts = {
        "run": str(run_path.resolve()),
        "loss": config.loss,
        "recipe": recipe,
        "mode": config.mode,
        "backbone": config.backbone,
        "selected checkpoint": selected,
        "test images": f"{comparison.images} ({len(np.unique(embedded.labels))} classes unseen in training)",
    }
    if summary is not None and summary.label_free is not None:
        record = summary.label_free
        facts["labels"] = (
            f"none for {record.loose_photos} training photos (pseudo-labels: k-means clusters, "
            f"{len(record.refreshes)} refreshes), class folders for {record.labelled_photos}; "
            f"{record.copies_merged} copies (byte or edited) merged"
        )
        facts["test images"] = (
            f"{record.held_out_photos['test']} held-out photos and one augmented view of each; the scores "
            f"below are {record.score}"
        )
    gate = serving_check(run_path)
    if gate.label_free:
        facts["served"] = (
            "yes: better than the untrained backbone on both checks of its held-out photos"
            if gate.passed
            else "no: the run learned nothing usable without labels, the untrained model stays served"
        ) + f" ({gate.detail})"
    else:  # the same rule as `dmlsearch export`: a report must not present a refused run as an improvement
        facts["served"] = (
            "yes: `dmlsearch export` serves it" if gate.passed else "no: `dmlsearch export` refuses it"
        ) + f" ({gate.detail})"
    idle = mostly_zero_loss(config.loss, RunDirectory(run_path).read_metrics())
    if idle is not None:
        facts["training loss"] = idle
    if summary is not None and summary.feedback is not None:  # its gate, and what to judge next
        facts["judgments"] = summary.feedback.describe()
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in facts.items())
    verdict = comparison.verdict
    if comparison.learned_nothing is not None:
        return (
            f"<dl>{items}</dl><p class='verdict worse'>The run <b>learned nothing</b>: "
            f"{html.escape(comparison.learned_nothing)}. Its selected checkpoint is step 0, the head "
            "training started from, so it is not compared with the backbone as a trained model: only the "
            "training curves are shown.</p>"
        )
    scores = "Recall@1"
    if gate.label_free:  # the gate's verdict leads: the test photos' check alone is not what serves a run
        verdict = "better" if gate.passed else "not served"
        scores = "On the held-out test photos' check (neither served nor refused on it), Recall@1"
    # Nor is a labelled run that export refuses shown as an improvement where its test classes gained (the
    # trials of issue 39): its banner is neutral and says so.
    refused = verdict == "better" and not gate.passed
    shade = "not-distinguishable" if refused else verdict.replace(" ", "-")
    why = (
        " This is the test images' verdict, but it is <b>not served</b>: `dmlsearch export` refuses it "
        "(see <i>served</i> above)."
        if refused
        else ""
    )
    return (
        f"<dl>{items}</dl>"
        f"<p class='verdict {shade}'>Trained vs the untrained backbone: "
        f"<b>{html.escape(verdict)}</b>. {scores} {100 * comparison.trained['recall@1']:.2f} vs "
        f"{100 * comparison.untrained['recall@1']:.2f}: {100 * interval.difference:+.2f} points, "
        f"{100 * interval.level:.0f}% CI [{100 * interval.low:+.2f}, {100 * interval.high:+.2f}] "
        f"(paired bootstrap, {interval.resamples} resamples of the queries).{why}</p>"
        + _metrics_table(comparison)
    )


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1150px; margin: 2em auto; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dt { font-weight: 600; } dd { margin: 0; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc; padding: 0.3em 0.7em; }
td { text-align: right; } th { text-align: left; background: #f6f6f6; }
.verdict { padding: 0.7em 1em; border-radius: 6px; font-size: 1.1em; }
.better { background: #e3f4e3; } .worse, .not-served { background: #f9e0e0; }
.not-distinguishable { background: #f2f2f2; }
figure { margin: 0; } img { max-width: 100%; } figcaption { color: #555; margin-bottom: 0.6em; }
"""


def write_report(run_path: Path, comparison: Comparison, embedded: RunEmbeddings, *, seed: int = 0) -> Report:
    """Draw every plot, write them under ``RUN/report/`` and the self-contained ``RUN/report.html``."""
    run = RunDirectory(run_path)
    records = run.read_metrics()
    trained, untrained = (
        top_hits(embedded.trained, embedded.labels),
        top_hits(embedded.untrained, embedded.labels),
    )
    summary = run.read_summary()
    best_step = 0 if summary is None else summary.best_step
    figures = {"training": training_figure(records, best_step)}
    if comparison.learned_nothing is None:  # else there is no training to compare with the backbone
        figures |= {
            "recall_at_k": recall_figure(embedded),
            "per_class": per_class_figure(per_class_change(embedded, trained, untrained)),
            "embedding_map": embedding_figure(embedded, seed),
            "examples": examples_figure(embedded, trained, untrained, seed),
        }
    plots, sections = {}, []
    if summary is not None and summary.label_free is not None:  # on the page, not among the served plots
        encoded = base64.b64encode(_png(pseudo_label_figure(summary.label_free))).decode("ascii")
        sections.append(
            f"<figure><figcaption>{html.escape(PSEUDO_LABEL_CAPTION)}</figcaption>"
            f"<img alt='pseudo_labels' src='data:image/png;base64,{encoded}'></figure>"
        )
    for name, caption in PLOTS.items():
        path = plot_path(run_path, name)
        if name not in figures:
            path.unlink(missing_ok=True)  # an earlier report's plot must not stand for this run
            continue
        data = _png(figures[name])
        with atomic_path(path) as temporary:
            temporary.write_bytes(data)
        plots[name] = path
        encoded = base64.b64encode(data).decode("ascii")
        sections.append(
            f"<figure><figcaption>{html.escape(caption)}</figcaption>"
            f"<img alt='{name}' src='data:image/png;base64,{encoded}'></figure>"
        )
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    title = f"dmlsearch report: {embedded.config.loss} run '{run_path.name}'"
    page = (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1><p>written {created}</p>"
        f"<h2>Is it better than no training?</h2>{_summary_html(run_path, comparison, embedded)}"
        f"<h2>Pictures</h2>{''.join(sections)}</body></html>\n"
    )
    html_path = run_path / REPORT_FILE
    atomic_write_text(html_path, page)
    return Report(html_path, plots)
