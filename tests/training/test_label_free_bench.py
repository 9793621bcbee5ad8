"""bench/lib/label_free.py: a run trained without labels, scored with them in both settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.lib.label_free import markdown, run_setting
from bench.lib.label_free_cv import (
    CVRow,
    auto_choice,
    fold_classes,
    fold_tables,
    gate_tally,
    merged,
    per_loss,
    run_fold,
    winners,
)
from bench.lib.label_free_cv import markdown as cv_markdown
from bench.lib.label_free_gate import Subset, Verdict, both, summary_rows
from training.data import load_labelled_images, split_classes
from training.features import FeatureExtractor
from training.losses import LOSSES
from training.metrics import evaluate
from training.recipes import LABEL_FREE_AUTO_LOSS


@pytest.mark.parametrize("setting", ["unseen", "own-gallery"])
def test_a_label_free_run_is_scored_with_the_labels_it_never_saw(
    setting: str, labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    # The synthetic classes are crops and tints of one picture each: edited copies, which the duplicate
    # finder would merge into too few photos to hold any out; byte copies only, as distinct photos would be.
    tiny = {"max_steps": 6, "eval_every": 3, "embedding_dim": 16, "head_hidden": 32, "copies": "exact"}
    row = run_setting("contrastive", setting, labelled_folder, tmp_path, seed=0, cache=feature_cache, **tiny)
    images = load_labelled_images(labelled_folder)
    test = split_classes(images).test  # both settings search the second half's classes
    backbone = FeatureExtractor(feature_cache, progress=False).extract(images.files(test)).features
    expected = evaluate(backbone, images.labels[test])["recall@1"]
    assert row.untrained == round(100 * expected, 2)
    assert row.gain == round(row.recall_at_1 - row.untrained, 2)
    config = json.loads((tmp_path / f"contrastive-{setting}-seed0" / "config.json").read_text())
    assert config["labels"] == "none"  # trained without them
    trained_on = load_labelled_images(Path(config["data"]))
    trained_test = set(images.paths[i] for i in test)
    in_test = {
        Path(p).relative_to(labelled_folder.resolve()).as_posix() in trained_test for p in trained_on.paths
    }
    assert in_test == ({True} if setting == "own-gallery" else {False})
    assert f"| contrastive | {setting} |" in markdown([row], "python bench/label_free.py")


def test_two_checks_gate_together_only_where_both_serve_the_same_checkpoint() -> None:
    def verdict(check: str, seed: int, step: int, served: bool, gain: float) -> Verdict:
        return Verdict(
            "ms", "A", "unseen", seed, check, 48, step, 90.0, 95.0, 1.0, 9.0, served, 0, 0, 0, gain, False
        )

    verdicts = [
        verdict("crop", 0, 200, True, 2.0),
        verdict("strong-neighbours", 0, 200, True, 2.0),  # both serve step 200: served
        verdict("crop", 1, 100, True, -1.0),
        verdict("strong-neighbours", 1, 300, True, -1.5),  # both serve, other steps: refused
        verdict("crop", 2, 100, False, 0.5),
        verdict("strong-neighbours", 2, 100, True, 0.5),  # crop refuses: refused
    ]
    combined = both(verdicts, "crop", "strong-neighbours")
    assert [(v.check, v.seed, v.selected_step, v.served) for v in combined] == [
        ("crop+strong-neighbours", 0, 200, True),
        ("crop+strong-neighbours", 1, 300, False),
        ("crop+strong-neighbours", 2, 100, False),
    ]
    assert [v.agrees for v in combined] == [True, True, False]  # seed 2 gained and was refused
    rows = {row["check"]: row for row in summary_rows(verdicts + combined)}
    assert (
        rows["crop+strong-neighbours"]["served"] == 1
        and rows["strong-neighbours"]["served_below_untrained"] == 1
    )


def test_class_folds_are_disjoint_and_spread_over_every_class() -> None:
    folds = fold_classes(196, 3, 32)
    assert [len(f) for f in folds] == [32, 32, 32]
    assert not set(folds[0]) & set(folds[1]) and not set(folds[1]) & set(folds[2])
    assert folds[0][:2] == [0, 6] and folds[2][-1] == 188  # every sixth class, to the end of the classes
    with pytest.raises(ValueError, match="do not fit"):
        fold_classes(196, 3, 98)


def _row(method: str, fold: int, seed: int, own: float, unseen: float, served: bool = False) -> CVRow:
    return CVRow(method, fold, seed, 400, 50 + own, 50.0, 40 + unseen, 40.0, served, 200, "-", "-", 1.0)


def test_the_cv_tables_say_how_the_choice_moved_and_what_the_gate_served() -> None:
    rows = [
        *(_row("ms", k, 0, 1.0, 1.0) for k in range(3)),
        _row("ms", 0, 1, 2.0, 1.0),
        # angular: better on average, and on fold 2 (one seed each: no spread) 2 and 3 points below ms
        _row("angular", 0, 0, 4.0, 3.0, served=True),
        _row("angular", 1, 0, 4.0, 3.0),
        _row("angular", 2, 0, -1.0, -2.0, served=True),
        _row("angular", 0, 1, 3.0, 3.0),
        # magnet: better than ms on average; on fold 0 below ms's 1.5 own-gallery gain, within its seeds' 1.0
        _row("magnet", 0, 0, 1.0, 1.5),
        *(_row("magnet", k, 0, 1.5, 1.5) for k in (1, 2)),
    ]
    table = per_loss(rows)
    assert table["angular"]["own-gallery"]["mean"] == 2.5 and table["angular"]["own-gallery"]["sd"] == 2.38
    assert table["angular"]["own-gallery"]["by_fold"] == {0: 3.5, 1: 4.0, 2: -1.0}
    assert table["angular"]["unseen"]["served_mean"] == round((3.0 - 2.0) / 4, 2)  # refused runs count 0
    moved = winners(rows, "own-gallery")
    assert moved["fold 0 seed 0"].startswith("angular") and moved["fold 2 seed 0"].startswith("magnet")
    assert "fold 0 seed 1" not in moved  # magnet has no seed 1 there: no winner among all losses
    assert "seed 1" not in moved and moved["seed 0"].startswith("angular")
    gate = gate_tally(rows)
    assert (gate["runs_served"], gate["served_below_untrained"], gate["worst_served"]) == (2, 2, -2.0)
    assert gate["cases"] == 2 * len(rows) and gate["refused_gained"] == 2 * (len(rows) - 2)
    choice = auto_choice(rows)
    assert choice["eligible"] == ["ms", "magnet"] and choice["chosen"] == "magnet"
    assert auto_choice([r for r in rows if r.method != "magnet"])["chosen"] == "ms"  # angular not eligible
    text = cv_markdown(rows, ["python bench/label_free_cv.py"], fold_classes(196, 3, 32), 16)
    assert "| angular | 0 | 0 | 400 | 200 | 54.00 | 50.00 | +4.00 |" in text and "'chosen': 'magnet'" in text


def test_a_merged_record_keeps_its_own_rows_and_adds_the_others_runs() -> None:
    mine = {"commands": ["a"], "rows": [_row("ms", 0, 0, 1.0, 1.0).to_dict()]}
    other = {
        "commands": ["b"],
        "rows": [_row("ms", 0, 0, 9.0, 9.0).to_dict(), _row("ms", 1, 0, 2.0, 2.0).to_dict()],
    }
    both_records = merged(mine, other)
    assert both_records["commands"] == ["a", "b"]
    assert [CVRow.from_dict(r).gain("unseen") for r in both_records["rows"]] == [1.0, 2.0]
    scored_again = {"commands": [], "rows": [{**_row("ms", 1, 0, 2.0, 2.0).to_dict(), "minutes": 0.0}]}
    trained = {"commands": [], "rows": [{**_row("ms", 1, 0, 2.0, 2.0).to_dict(), "minutes": 0.4}]}
    assert merged(scored_again, trained)["rows"][0]["minutes"] == 0.4  # the row of the grid that trained it


def test_a_fold_run_trains_without_labels_and_is_scored_on_its_own_and_the_next_folds_classes(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    folds = fold_classes(12, 3, 4)  # 12 classes of 5: folds of 4 classes, 20 photos
    every, tables = fold_tables(labelled_folder, folds, 5, tmp_path)
    subset = Subset.load(every, feature_cache)
    rows = [np.arange(20 * k, 20 * (k + 1)) for k in range(3)]
    tiny = {"embedding_dim": 16, "head_hidden": 32, "copies": "exact"}
    row = run_fold("contrastive", 2, subset, rows, tables, tmp_path, seed=0, steps=4, every=2, **tiny)
    config = json.loads((tmp_path / "runs" / "contrastive-fold2-seed0" / "config.json").read_text())
    assert config["labels"] == "none" and config["data"] == str(tables[2]) and config["max_steps"] == 4
    images = load_labelled_images(every)
    assert set(images.labels[rows[2]]) == {2, 5, 8, 11}  # fold 2: every third class from class 2
    for setting, scored in (("own_gallery", rows[2]), ("unseen", rows[0])):  # the next fold of 2 is 0
        expected = evaluate(subset.served[scored], images.labels[scored])["recall@1"]
        assert getattr(row, f"{setting}_untrained") == round(100 * expected, 2)
    summary = json.loads((tmp_path / "runs" / "contrastive-fold2-seed0" / "summary.json").read_text())
    assert row.served == bool(summary["beats_backbone"]) and row.steps == 4


def test_the_label_free_auto_loss_is_the_class_fold_cvs_choice() -> None:
    """`--loss auto` without labels trains what bench/results/label_free_cv.json's rule chooses: changing
    either alone fails here."""
    record = json.loads((Path(__file__).parents[2] / "bench/results/label_free_cv.json").read_text())
    rows = [CVRow.from_dict(row) for row in record["rows"]]
    assert {r.method for r in rows} == set(LOSSES)  # every registered loss ran
    assert len({(r.fold, r.seed) for r in rows}) >= 6 and auto_choice(rows)["chosen"] == LABEL_FREE_AUTO_LOSS
