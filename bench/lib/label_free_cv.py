"""Class-fold cross-validation of the losses trained without labels (issue 39): what bench/label_free_cv.py
runs and tabulates.

K disjoint class folds of a labelled folder, spread over its classes (fold k: classes k, k + s, k + 2s, ...
with s = classes // per-fold classes), the first photos of each class. A run trains one loss's label-free
recipe (``--labels none``, frozen, a fixed number of steps) on one fold's photos, and its selected
checkpoint is scored by class Recall@1 with the labels (used only here): on the fold's own photos
(``own-gallery``) and on the next fold's classes (``unseen``), each against the untrained backbone on the
same photos. Every run also records whether the trainer's label-free gate served it. Tested:
tests/training/test_label_free_bench.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.data import load_labelled_images
from training.label_free_data import label_free_images
from training.recipes import resolve
from training.run_dir import RunDirectory
from training.trainer import train

from .label_free_gate import VIEW_SEED, Subset, class_recall, class_table, objective_embed, share_cache

SETTINGS = ("own-gallery", "unseen")
BASELINE = "ms"  # the label-free `--loss auto` choice the CV is held against


def fold_classes(classes: int, folds: int, per_fold: int) -> list[list[int]]:
    """``folds`` disjoint lists of ``per_fold`` class ids (counted from 0) spread over ``classes``."""
    stride = classes // per_fold
    if folds > stride:
        raise ValueError(f"{folds} folds of {per_fold} classes do not fit {classes} classes")
    return [[k + j * stride for j in range(per_fold)] for k in range(folds)]


def fold_tables(data: Path, folds: list[list[int]], per_class: int, work: Path) -> tuple[Path, list[Path]]:
    """One ``path,label`` table per fold, and one of every fold's photos, fold after fold (the scored set)."""
    images = load_labelled_images(data)
    tables = [
        class_table(images, classes, per_class, work / f"fold{k}.csv") for k, classes in enumerate(folds)
    ]
    every = class_table(images, [c for classes in folds for c in classes], per_class, work / "folds.csv")
    return every, tables


@dataclass(frozen=True)
class CVRow:
    method: str
    fold: int
    seed: int
    steps: int
    own_gallery: float  # class Recall@1 (%) of the selected checkpoint on the fold's own photos
    own_gallery_untrained: float
    unseen: float  # ... on the next fold's classes
    unseen_untrained: float
    served: bool  # the trainer's label-free gate served the run (else the untrained model stays)
    best_step: int
    crop_check: str  # the gate's first check, as the trainer recorded it: difference [low, high] verdict
    neighbours_check: str  # its second check ("-": not scored, the first did not pass)
    minutes: float

    def gain(self, setting: str) -> float:
        if setting == "own-gallery":
            return round(self.own_gallery - self.own_gallery_untrained, 2)
        return round(self.unseen - self.unseen_untrained, 2)

    def served_gain(self, setting: str) -> float:
        """What a user ends up with: the gain where the gate served the run, else 0 (untrained served)."""
        return self.gain(setting) if self.served else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **{f"gain_{s}": self.gain(s) for s in SETTINGS}}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> CVRow:
        return cls(**{key: record[key] for key in cls.__dataclass_fields__})


def run_fold(
    method: str,
    fold: int,
    subset: Subset,
    fold_rows: list[np.ndarray],
    tables: list[Path],
    work: Path,
    *,
    seed: int,
    steps: int,
    every: int,
    **settings: Any,
) -> CVRow:
    """Train ``method`` without labels on fold ``fold``'s photos for ``steps`` steps (frozen; its features
    shared from ``subset``'s, so all runs of a fold read one cache; ``settings``: values over the recipe)
    and score its selected checkpoint."""
    cache = work / "cache" / f"fold{fold}"
    loose = label_free_images(tables[fold], "none")
    assert loose is not None
    share_cache(subset, subset.row_of(loose.files()), cache)
    overrides = {
        "max_steps": steps,
        "eval_every": every,
        "patience": 10**6,
        "view_seed": VIEW_SEED,
        **settings,
    }
    config = resolve(method, overrides=overrides, mode="frozen", label_free=True).config(
        method, str(tables[fold]), labels="none", seed=seed, cache_dir=str(cache.resolve())
    )
    run = work / "runs" / f"{method}-fold{fold}-seed{seed}"
    started = time.perf_counter()
    summary = train(config, run, progress=False)
    minutes = (time.perf_counter() - started) / 60
    embed = objective_embed(config, RunDirectory(run).require_best().objective, subset.served.shape[1])
    own, unseen = fold_rows[fold], fold_rows[(fold + 1) % len(fold_rows)]

    def untrained(features: np.ndarray) -> np.ndarray:
        return features.copy()

    percent = {
        name: round(100 * class_recall(subset, model, rows), 2)
        for name, model, rows in (
            ("own_gallery", embed, own),
            ("own_gallery_untrained", untrained, own),
            ("unseen", embed, unseen),
            ("unseen_untrained", untrained, unseen),
        )
    }
    record = summary.label_free
    neighbours = record.neighbours if record is not None else None
    return CVRow(
        method=method,
        fold=fold,
        seed=seed,
        steps=summary.steps,
        served=bool(summary.beats_backbone),
        best_step=summary.best_step,
        crop_check=_interval(summary.validation_gain),
        neighbours_check=_interval(neighbours.interval if neighbours is not None else None),
        minutes=round(minutes, 1),
        **percent,
    )


def _interval(interval: Any) -> str:
    if interval is None:
        return "-"
    return (
        f"{100 * interval.difference:+.2f} [{100 * interval.low:+.2f}, {100 * interval.high:+.2f}] "
        f"{interval.verdict}"
    )


def merged(record: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``other``'s commands and runs (a run: loss, fold, seed). A run in both keeps the row
    that trained it: the other grid found the run finished and only scored it again (0 minutes)."""
    rows = {_key(row): row for row in record["rows"]}
    for row in other["rows"]:
        if _key(row) not in rows or row["minutes"] > rows[_key(row)]["minutes"]:
            rows[_key(row)] = row
    commands = [*record["commands"], *(c for c in other["commands"] if c not in record["commands"])]
    return {**record, "commands": commands, "rows": list(rows.values())}


def _key(row: dict[str, Any]) -> tuple[str, int, int]:
    return row["method"], row["fold"], row["seed"]


def per_loss(rows: list[CVRow]) -> dict[str, dict[str, Any]]:
    """Per loss, per setting: mean and sd of the gain over its folds x seeds, the served gain's mean, the
    worst fold (mean over seeds), and the runs."""
    table: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        entry: dict[str, Any] = {"runs": len(mine), "served": sum(r.served for r in mine)}
        for setting in SETTINGS:
            gains = [r.gain(setting) for r in mine]
            entry[setting] = {
                "mean": round(statistics.fmean(gains), 2),
                "sd": round(statistics.stdev(gains), 2) if len(gains) > 1 else None,
                "served_mean": round(statistics.fmean(r.served_gain(setting) for r in mine), 2),
                "by_fold": fold_means(mine, setting),
            }
        table[method] = entry
    return table


def fold_means(rows: list[CVRow], setting: str) -> dict[int, float]:
    folds = sorted({r.fold for r in rows})
    return {k: round(statistics.fmean(r.gain(setting) for r in rows if r.fold == k), 2) for k in folds}


def winners(rows: list[CVRow], setting: str) -> dict[str, str]:
    """The loss with the highest gain in ``setting``: per fold-and-seed case that every loss ran, per fold
    (mean over the seeds every loss ran there), per seed (mean over the folds, where every loss ran all)."""
    methods = sorted({r.method for r in rows})
    found: dict[str, str] = {}
    cases = sorted({(r.fold, r.seed) for r in rows})

    def best(pool: list[CVRow]) -> str:
        means = {m: statistics.fmean(r.gain(setting) for r in pool if r.method == m) for m in methods}
        top = max(means.values())
        return ", ".join(f"{m} ({means[m]:+.2f})" for m in methods if means[m] == top)

    def complete(pool: list[CVRow]) -> bool:
        return {r.method for r in pool} == set(methods)

    for fold, seed in cases:
        pool = [r for r in rows if (r.fold, r.seed) == (fold, seed)]
        if complete(pool):
            found[f"fold {fold} seed {seed}"] = best(pool)
    for fold in sorted({r.fold for r in rows}):
        shared = [
            s
            for s in sorted({r.seed for r in rows})
            if complete([r for r in rows if (r.fold, r.seed) == (fold, s)])
        ]
        pool = [r for r in rows if r.fold == fold and r.seed in shared]
        if pool:
            found[f"fold {fold}"] = best(pool)
    for seed in sorted({r.seed for r in rows}):
        shared_folds = [
            k
            for k in sorted({r.fold for r in rows})
            if complete([r for r in rows if (r.fold, r.seed) == (k, seed)])
        ]
        pool = [r for r in rows if r.seed == seed and r.fold in shared_folds]
        if pool and len(shared_folds) == len({r.fold for r in rows}):
            found[f"seed {seed}"] = best(pool)
    return found


def gate_tally(rows: list[CVRow]) -> dict[str, Any]:
    """The trainer's gate on these runs: each run is two cases (own-gallery, unseen); it agrees where it
    serves a case whose class Recall@1 rose, or refuses one whose did not."""
    cases = [(r, s) for r in rows for s in SETTINGS]
    below = [r.gain(s) for r, s in cases if r.served and r.gain(s) < 0]
    return {
        "runs": len(rows),
        "runs_served": sum(r.served for r in rows),
        "cases": len(cases),
        "cases_gained": sum(r.gain(s) > 0 for r, s in cases),
        "agreement": round(100 * statistics.fmean(r.served == (r.gain(s) > 0) for r, s in cases), 1)
        if cases
        else None,
        "served_below_untrained": len(below),
        "worst_served": min(below) if below else None,
        "refused_gained": sum((not r.served) and r.gain(s) > 0 for r, s in cases),
    }


def auto_choice(rows: list[CVRow], baseline: str = BASELINE) -> dict[str, Any]:
    """The rule for the label-free ``--loss auto``: the loss with the best mean gain over both settings,
    among those that ran every fold the baseline ran and are on no fold, in either setting, below the
    baseline (fold means over seeds) by more than the seeds' spread there (the larger of the two losses'
    max - min gain over their seeds on that fold: 0 with one seed). The baseline stays unless one beats it."""
    table = per_loss(rows)
    base = table[baseline]
    eligible = []
    for method, entry in table.items():
        worse = [
            (s, k)
            for s in SETTINGS
            for k, gain in base[s]["by_fold"].items()
            if k not in entry[s]["by_fold"]
            or entry[s]["by_fold"][k] < gain - seed_spread(rows, (method, baseline), k, s)
        ]
        if not worse:
            eligible.append(method)
    score = {m: round(statistics.fmean(table[m][s]["mean"] for s in SETTINGS), 2) for m in table}
    chosen = max(eligible, key=lambda m: (score[m], m == baseline))
    return {"mean_gain_both_settings": score, "eligible": eligible, "chosen": chosen}


def seed_spread(rows: list[CVRow], methods: tuple[str, ...], fold: int, setting: str) -> float:
    """The largest max - min gain in ``setting`` over the seeds of one of ``methods`` on ``fold``."""
    spreads = [0.0]
    for method in methods:
        gains = [r.gain(setting) for r in rows if (r.method, r.fold) == (method, fold)]
        if gains:
            spreads.append(max(gains) - min(gains))
    return round(max(spreads), 2)


def markdown(rows: list[CVRow], commands: list[str], folds: list[list[int]], per_class: int) -> str:
    table = per_loss(rows)
    gate = gate_tally(rows)
    choice = auto_choice(rows) if BASELINE in table else None
    lines = [
        "# Losses trained without labels, cross-validated over class folds (issue 39)",
        "",
        *(f"`{command}`" for command in commands),
        "",
        f"{len(folds)} class folds of Cars196, the first {per_class} photos of each class (class ids counted "
        "from 0 in name order): "
        + "; ".join(f"fold {k}: classes {c[0]}, {c[1]}, ... {c[-1]} ({len(c)})" for k, c in enumerate(folds))
        + ". Each run trains one loss's label-free recipe (`--labels none`, frozen, fixed steps) on one "
        "fold's photos; its selected checkpoint is scored by class Recall@1 with the labels (used only to "
        "score): own-gallery (the fold's own photos) and unseen (the next fold's classes). Gains in points "
        "over the untrained backbone on the same photos. served: the trainer's label-free gate served the "
        "run (else "
        "the untrained model stays: a served gain of 0).",
        "",
        "## Per loss (mean and sd over folds x seeds)",
        "",
        "| loss | runs | own-gallery gain | sd | unseen gain | sd | mean of both | served runs | served gain "
        "own / unseen | own-gallery gain by fold | unseen gain by fold |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(table, key=lambda m: -statistics.fmean(table[m][s]["mean"] for s in SETTINGS))
    for method in order:
        entry = table[method]
        own, unseen = entry["own-gallery"], entry["unseen"]
        lines.append(
            f"| {method} | {entry['runs']} | {own['mean']:+.2f} | {_sd(own['sd'])} | {unseen['mean']:+.2f} | "
            f"{_sd(unseen['sd'])} | {(own['mean'] + unseen['mean']) / 2:+.2f} | {entry['served']} | "
            f"{own['served_mean']:+.2f} / {unseen['served_mean']:+.2f} | {_by_fold(own['by_fold'])} | "
            f"{_by_fold(unseen['by_fold'])} |"
        )
    lines += ["", "## How the choice moved: the winner per fold-and-seed case, per fold, per seed", ""]
    lines += ["| case | own-gallery winner | unseen winner |", "|---|---|---|"]
    own_wins, unseen_wins = winners(rows, "own-gallery"), winners(rows, "unseen")
    lines += [f"| {case} | {own_wins[case]} | {unseen_wins.get(case, '-')} |" for case in own_wins]
    lines += [
        "",
        "## The trainer's gate on these runs",
        "",
        "Each run is two cases (own-gallery, unseen); the gate agrees where it serves a case whose class "
        f"Recall@1 rose or refuses one whose did not: {gate}",
        "",
    ]
    if choice is not None:
        lines += [
            "## The label-free `--loss auto` rule",
            "",
            "The loss with the best mean gain over both settings, among those no worse than "
            f"{BASELINE} on any fold (mean over seeds), in either setting, by more than the seeds' spread "
            f"there (the larger max - min gain over seeds of the two losses on that fold): {choice}",
            "",
        ]
    lines += [
        "## Every run",
        "",
        "| loss | fold | seed | steps | best step | own-gallery | untrained | gain | unseen | untrained | "
        "gain | served | crop check | neighbours check | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.method} | {r.fold} | {r.seed} | {r.steps} | {r.best_step} | {r.own_gallery:.2f} | "
        f"{r.own_gallery_untrained:.2f} | {r.gain('own-gallery'):+.2f} | {r.unseen:.2f} | "
        f"{r.unseen_untrained:.2f} | {r.gain('unseen'):+.2f} | {'yes' if r.served else 'no'} | "
        f"{r.crop_check} | {r.neighbours_check} | {r.minutes:.1f} |"
        for r in sorted(rows, key=lambda r: (r.method, r.fold, r.seed))
    ]
    return "\n".join(lines) + "\n"


def _sd(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _by_fold(by_fold: dict[int, float]) -> str:
    return " / ".join(f"{gain:+.2f}" for _, gain in sorted(by_fold.items()))


def plot(rows: list[CVRow], path: Path) -> None:
    """The gain per loss across folds (one marker per fold-and-seed run, edged where the gate served the
    run), one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = per_loss(rows)
    order = sorted(table, key=lambda m: -statistics.fmean(table[m][s]["mean"] for s in SETTINGS))
    figure, axes = plt.subplots(1, len(SETTINGS), figsize=(12, 5), sharey=True)
    markers = "osD^v"
    for axis, setting in zip(axes, SETTINGS, strict=True):
        for fold in sorted({r.fold for r in rows}):
            for seed in sorted({r.seed for r in rows}):
                mine = [r for r in rows if (r.fold, r.seed) == (fold, seed)]
                if mine:
                    axis.scatter(
                        np.array([order.index(r.method) for r in mine]) + 0.12 * (fold - 1),
                        [r.gain(setting) for r in mine],
                        marker=markers[seed % len(markers)],
                        color=f"C{fold}",
                        edgecolors=["black" if r.served else "none" for r in mine],
                        linewidths=1.5,
                        label=f"fold {fold} seed {seed}",
                        s=28,
                    )
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.set_xticks(range(len(order)), order, rotation=60, ha="right")
        axis.set_title(f"{setting}: class Recall@1 gain over untrained")
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("points")
    figure.suptitle("Losses trained without labels, per class fold (black edge: the gate served the run)")
    axes[-1].legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
