"""bench/lib/label_free.py: a run trained without labels, scored with them in both settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lib.label_free import markdown, run_setting
from bench.lib.label_free_gate import Verdict, both, summary_rows
from training.data import load_labelled_images, split_classes
from training.features import FeatureExtractor
from training.metrics import evaluate


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
