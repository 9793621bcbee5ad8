"""bench/lib/label_free_retention.py: class structure kept by a label-free run, and the floor's choice."""

from __future__ import annotations

import numpy as np

from bench.lib.label_free_cv import CVRow
from bench.lib.label_free_retention import (
    Scored,
    choose_band,
    choose_floor,
    confident_pairs,
    leave_one_fold_out,
    overlap,
    retention,
    tally,
)


def _clustered(seed: int = 0, classes: int = 8, per_class: int = 6) -> np.ndarray:
    """Tight classes: each photo's mutual nearest neighbour is of its class."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, 32))
    return np.repeat(centres, per_class, axis=0) + 0.05 * rng.normal(size=(classes * per_class, 32))


def test_the_untrained_model_keeps_all_its_structure_and_a_scrambled_one_loses_it() -> None:
    untrained = _clustered()
    pairs = confident_pairs(untrained, 1.0)
    assert len(pairs) > 0 and (pairs[:, 0] // 6 == pairs[:, 1] // 6).all()  # mutual pairs: one class
    assert retention(untrained, untrained).mean() == 1.0
    assert overlap(untrained, untrained).mean() == 1.0
    scrambled = untrained[np.random.default_rng(1).permutation(len(untrained))]  # classes collapsed
    assert retention(untrained, scrambled, share=1.0, k=1).mean() < 0.3
    assert overlap(untrained, scrambled).mean() < 0.3


def _run(fold: int, seed: int, score: float, own: float, unseen: float, served: bool = True) -> Scored:
    row = CVRow(
        method="m",
        fold=fold,
        seed=seed,
        steps=4,
        own_gallery=50 + own,
        own_gallery_untrained=50,
        unseen=50 + unseen,
        unseen_untrained=50,
        served=served,
        best_step=4,
        crop_check="-",
        neighbours_check="-",
        minutes=0.0,
    )
    return Scored(
        row=row, scores={"kept": score}, intervals={"kept": (score, 1.0)}, pairs=1, pairs_one_class=1
    )


def test_the_floor_refuses_the_collapsed_runs_and_is_counted_on_the_held_out_fold() -> None:
    runs = [
        _run(0, 0, 0.6, -5, -8),  # collapsed, served by the gate as it is
        _run(0, 1, 0.9, 2, 1),
        _run(1, 0, 0.5, -4, -7),
        _run(1, 1, 0.9, 1, 2),
        _run(2, 0, 0.7, -3, -6),
        _run(2, 1, 0.9, 3, 1),
    ]
    assert tally(runs, None, 0.0)["served_below_untrained"] == 6
    assert choose_floor(runs, "kept", "strict") == 0.9
    assert choose_floor(runs, "kept", "net") == 0.9
    for entry in leave_one_fold_out(runs, "kept", "strict"):
        assert entry["gate_now"]["served_below_untrained"] == 2
        assert entry["with_floor"]["served_below_untrained"] == 0
        assert entry["with_floor"]["served_gained"] == 2
    # a held-out fold whose collapsed run scores above the floor chosen on the others is served, and counted
    runs[0] = _run(0, 0, 0.91, -5, -8)
    held = leave_one_fold_out(runs, "kept", "strict")[0]
    assert held["with_floor"]["served_below_untrained"] == 2 and held["with_floor"]["worst_served"] == -8


def _moved(run: Scored, moved: float) -> Scored:
    return Scored(
        row=run.row,
        scores={"retention@1": run.scores["kept"], "overlap@10": moved},
        intervals={},
        pairs=1,
        pairs_one_class=1,
    )


def test_the_band_refuses_a_run_that_kept_its_pairs_but_barely_moved() -> None:
    runs = [
        _moved(_run(0, 0, 0.6, -5, -8), 0.6),  # collapsed
        _moved(_run(0, 1, 0.9, 2, 1), 0.65),  # kept its pairs and moved: gained in both settings
        _moved(_run(1, 0, 0.92, 1, -3), 0.85),  # kept its pairs, barely moved: lost on unseen classes
        _moved(_run(1, 1, 0.88, 1, 2), 0.7),
    ]
    assert choose_floor([_moved_back(r) for r in runs], "kept", "strict") == np.inf  # no floor alone
    for ties in ("loose", "tight"):
        floor, ceiling = choose_band(runs, ties)
        found = tally(runs, "retention@1", floor, ("overlap@10", ceiling))
        assert found["served_below_untrained"] == 0 and found["served_gained"] == 4
    assert choose_band(runs, "loose") == choose_band(runs, "tight") == (0.88, 0.7)


def _moved_back(run: Scored) -> Scored:
    return Scored(
        row=run.row, scores={"kept": run.scores["retention@1"]}, intervals={}, pairs=1, pairs_one_class=1
    )
