"""Label-free checks of class structure kept, replayed on the class-fold runs (issue 39, gate without labels).

The trainer's label-free gate asks two checks (crop, neighbourhood agreement) to find the selected
checkpoint better than the untrained backbone; both measure invariance to augmentation, and a loss that
collapses class structure while learning invariance passes both. The candidates here ask instead how
much of the untrained backbone's structure on the run's own photos (its folder: training and held-out
photos, no labels) the selected checkpoint keeps:

* ``retention@10``: the untrained backbone's *confident pairs* (mutual nearest neighbours whose cosine is
  in the top half of all mutual pairs' cosines: mostly one class under an ImageNet backbone) -- the share
  of them whose partner is still among each photo's 10 nearest under the trained model (per pair, both
  directions averaged);
* ``retention@1``: the same over *every* mutual pair, each photo's partner still its nearest;
* ``overlap@10``: per photo, the share of its 10 nearest under the untrained backbone that stay among its
  10 nearest under the trained model.

Both are 1 for the untrained backbone itself; each is reported with a bootstrap interval over its pairs
or photos (training/bootstrap.py). A rule adds one candidate to the trainer's gate as a floor
(``served and candidate >= floor``); the floor is chosen by leave-one-fold-out: on the other folds' runs,
either the lowest floor under which no served case is below untrained (``strict``: the goal), or the
floor with the most served cases that gained less those below untrained (``net``), then counted on the
held-out fold. A *band* (:data:`BAND`: a floor on ``retention@1`` and a ceiling on ``overlap@10``, a run
that kept its mutual pairs yet moved its neighbourhoods) is chosen the same way; its form was picked after
looking at every run's scores, so its held-out figures are weaker evidence than the single floors'.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from training.bootstrap import paired_bootstrap
from training.metrics import nearest_neighbours

from .label_free_cv import SETTINGS, CVRow

NEIGHBOURS = 10  # as the trainer's neighbourhood check
CONFIDENT_SHARE = 0.5  # the top half of the untrained backbone's mutual-neighbour pairs, by cosine
OBJECTIVES = ("strict", "net")


def confident_pairs(untrained: np.ndarray, share: float = CONFIDENT_SHARE) -> np.ndarray:
    """(pairs, 2) rows of mutual nearest neighbours under ``untrained`` whose cosine is in the top
    ``share`` of all mutual pairs' cosines."""
    nearest = nearest_neighbours(untrained, 1)[:, 0]
    first = np.flatnonzero(nearest[nearest] == np.arange(len(nearest)))
    first = first[first < nearest[first]]
    pairs = np.stack([first, nearest[first]], axis=1)
    unit = untrained / np.linalg.norm(untrained, axis=1, keepdims=True)
    cosine = np.einsum("ij,ij->i", unit[pairs[:, 0]], unit[pairs[:, 1]])
    return pairs[cosine >= np.quantile(cosine, 1 - share)]


def retention(
    untrained: np.ndarray, trained: np.ndarray, *, share: float = CONFIDENT_SHARE, k: int = NEIGHBOURS
) -> np.ndarray:
    """Per confident pair of ``untrained`` (the top ``share`` of mutual pairs): the share of its two
    photos that keep the other among their ``k`` nearest under ``trained`` (0, 0.5 or 1)."""
    pairs = confident_pairs(untrained, share)
    around = nearest_neighbours(trained, k)
    kept = [(b in around[a]) + (a in around[b]) for a, b in pairs]
    return np.asarray(kept, dtype=np.float64) / 2


def overlap(untrained: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Per photo: the share of its :data:`NEIGHBOURS` nearest under ``untrained`` kept under ``trained``."""
    before, after = nearest_neighbours(untrained, NEIGHBOURS), nearest_neighbours(trained, NEIGHBOURS)
    shared = [len(np.intersect1d(a, b)) for a, b in zip(before, after, strict=True)]
    return np.asarray(shared, dtype=np.float64) / NEIGHBOURS


@dataclass(frozen=True)
class Scored:
    """One run of the class-fold CV with each candidate's score (mean, interval vs untrained's 1)."""

    row: CVRow
    scores: dict[str, float]
    intervals: dict[str, tuple[float, float]]
    pairs: int
    pairs_one_class: float  # share of the confident pairs within one class (labels: reported only)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "row": self.row.to_dict()}


CANDIDATES = ("retention@10", "retention@1", "overlap@10")


def score_run(row: CVRow, untrained: np.ndarray, trained: np.ndarray, labels: np.ndarray) -> Scored:
    """Each candidate on one run's folder photos (``untrained`` and ``trained`` embeddings of them)."""
    per_item = {
        "retention@10": retention(untrained, trained),
        "retention@1": retention(untrained, trained, share=1.0, k=1),
        "overlap@10": overlap(untrained, trained),
    }
    scores, intervals = {}, {}
    for name, values in per_item.items():
        interval = paired_bootstrap(values, np.ones_like(values), seed=row.seed)
        scores[name] = round(float(values.mean()), 4)
        intervals[name] = (round(1 + interval.low, 4), round(1 + interval.high, 4))
    pairs = confident_pairs(untrained)
    return Scored(
        row=row,
        scores=scores,
        intervals=intervals,
        pairs=len(pairs),
        pairs_one_class=round(float(np.mean(labels[pairs[:, 0]] == labels[pairs[:, 1]])), 3),
    )


def tally(
    runs: list[Scored], candidate: str | None, floor: float, ceiling: tuple[str, float] | None = None
) -> dict[str, Any]:
    """The trainer's gate with ``candidate >= floor`` added (``None``: the gate as it is), and, given a
    ``ceiling`` (another candidate, its highest value), that candidate at most that value; case by case."""
    cases = [(run, setting) for run in runs for setting in SETTINGS]

    def served(run: Scored) -> bool:
        above = candidate is None or run.scores[candidate] >= floor
        return run.row.served and above and (ceiling is None or run.scores[ceiling[0]] <= ceiling[1])

    below = [run.row.gain(s) for run, s in cases if served(run) and run.row.gain(s) < 0]
    return {
        "runs": len(runs),
        "runs_served": sum(served(run) for run in runs),
        "cases": len(cases),
        "cases_gained": sum(run.row.gain(s) > 0 for run, s in cases),
        "served_gained": sum(served(run) and run.row.gain(s) > 0 for run, s in cases),
        "served_below_untrained": len(below),
        "worst_served": min(below) if below else None,
        "refused_gained": sum((not served(run)) and run.row.gain(s) > 0 for run, s in cases),
        "agreement": round(
            100 * float(np.mean([served(run) == (run.row.gain(s) > 0) for run, s in cases])), 1
        )
        if cases
        else None,
    }


def choose_floor(runs: list[Scored], candidate: str, objective: str) -> float:
    """The floor, among the runs' own scores (or above all of them), that ``objective`` picks on ``runs``:
    ``strict``: the lowest with no served case below untrained; ``net``: the most served cases that
    gained less those below untrained (the lowest of ties)."""
    floors = [*sorted({run.scores[candidate] for run in runs}), np.inf]
    tallies = [tally(runs, candidate, floor) for floor in floors]
    if objective == "strict":
        return float(
            next(f for f, t in zip(floors, tallies, strict=True) if t["served_below_untrained"] == 0)
        )
    nets = [t["served_gained"] - t["served_below_untrained"] for t in tallies]
    return float(floors[int(np.argmax(nets))])


def leave_one_fold_out(runs: list[Scored], candidate: str, objective: str) -> list[dict[str, Any]]:
    """Per held-out fold: the floor ``objective`` chose on the other folds, and the gate's tally on the
    held-out fold as it is and with the floor."""
    results = []
    for fold in sorted({run.row.fold for run in runs}):
        chosen_on = [run for run in runs if run.row.fold != fold]
        held = [run for run in runs if run.row.fold == fold]
        floor = choose_floor(chosen_on, candidate, objective)
        results.append(
            {
                "candidate": candidate,
                "held_out_fold": fold,
                "objective": objective,
                "floor": floor,
                "gate_now": tally(held, None, 0.0),
                "with_floor": tally(held, candidate, floor),
            }
        )
    return results


BAND = ("retention@1", "overlap@10")  # kept its mutual pairs, yet moved its neighbourhoods


BAND_TIES = ("loose", "tight")


def choose_band(runs: list[Scored], ties: str) -> tuple[float, float]:
    """The floor on :data:`BAND`'s first candidate and the ceiling on its second (among the runs' own
    scores) with no served case of ``runs`` below untrained and the most served cases that gained; of
    equally good bands, ``loose``: the lowest floor, then the highest ceiling; ``tight``: the highest
    floor, then the lowest ceiling."""
    kept, moved = BAND
    floors = [*sorted({run.scores[kept] for run in runs}), np.inf]
    ceilings = sorted({run.scores[moved] for run in runs}, reverse=True)
    if ties == "tight":
        floors, ceilings = floors[::-1], ceilings[::-1]
    best: tuple[int, float, float] = (-1, np.inf, ceilings[0])
    for floor in floors:
        for ceiling in ceilings:
            found = tally(runs, kept, floor, (moved, ceiling))
            if found["served_below_untrained"] == 0 and found["served_gained"] > best[0]:
                best = (found["served_gained"], floor, ceiling)
    return float(best[1]), float(best[2])


def band_leave_one_fold_out(runs: list[Scored], ties: str) -> list[dict[str, Any]]:
    """Per held-out fold: :func:`choose_band` on the other folds, and the gate's tally on the held-out
    fold as it is and with the band."""
    results = []
    for fold in sorted({run.row.fold for run in runs}):
        floor, ceiling = choose_band([run for run in runs if run.row.fold != fold], ties)
        held = [run for run in runs if run.row.fold == fold]
        results.append(
            {
                "ties": ties,
                "held_out_fold": fold,
                "floor": floor,
                "ceiling": ceiling,
                "gate_now": tally(held, None, 0.0),
                "with_band": tally(held, BAND[0], floor, (BAND[1], ceiling)),
            }
        )
    return results
