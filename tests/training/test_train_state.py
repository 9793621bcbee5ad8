"""The trainer's pieces that need no run: the records of a run directory's files, read and written as
the trainer always wrote them (its precision: test_precision.py)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from training.bootstrap import Interval
from training.run_dir import BestCheckpoint, LastCheckpoint, RunDirectory, RunDirError, RunSummary, TrainState

METRICS = {"recall@1": 0.5, "recall@2": 0.625, "map@r": 0.125}


def test_train_state_round_trips_through_a_checkpoint_dict() -> None:
    state = TrainState(step=7, best_step=4, best_score=0.5, since_best=1, stopped=True, elapsed=2.5)
    checkpoint = {**asdict(state), "objective": {}, "optimizer": {}}  # last.pt keeps both side by side
    assert TrainState.from_checkpoint(checkpoint) == state
    fresh = TrainState()
    assert (fresh.step, fresh.best_score, fresh.stopped) == (0, -math.inf, False)


def test_checkpoints_keep_the_dictionaries_they_always_held(tmp_path: Path) -> None:
    """last.pt: the progress's fields beside the components' states; best.pt: weights, step, metrics."""
    run = RunDirectory(tmp_path)
    state = TrainState(step=7, best_step=4, best_score=0.5, since_best=1, stopped=True, elapsed=2.5)
    components = {
        "objective": {"head.weight": [1.0]},
        "optimizer": {"param_groups": [{"lr": 0.1}]},
        "sampler": {"position": 3},
        "view_rng": {"bit_generator": "PCG64", "state": {"state": 5, "inc": 1}},
        "scaler": {},
    }
    run.save_last(LastCheckpoint(progress=state, **components))
    on_disk = torch.load(run.checkpoint_path("last"), weights_only=True)
    assert on_disk == {**asdict(state), **components} and list(on_disk)[:6] == list(asdict(state))
    assert run.load_last() == LastCheckpoint(progress=state, **components)
    run.save_best(BestCheckpoint(objective={"head.weight": [2.0]}, step=4, val=METRICS))
    best = torch.load(run.checkpoint_path("best"), weights_only=True)
    assert best == {"objective": {"head.weight": [2.0]}, "step": 4, "val": METRICS}
    assert run.require_best().step == 4
    assert RunDirectory(tmp_path / "empty").load_last() is None
    with pytest.raises(RunDirError, match="has no checkpoints/best"):
        RunDirectory(tmp_path / "empty").require_best()


# summary.json as the trainer wrote it before it recorded the untrained backbone (val_backbone,
# beats_backbone) and the validation interval (validation_gain): training/trainer.py at commit cdb6f6e.
FIRST_FORMAT = {
    "loss": "ms",
    "mode": "frozen",
    "steps": 12,
    "stopped_early": False,
    "best_step": 8,
    "train_seconds": 3.4,
    "val": METRICS,
    "test": METRICS,
    "test_backbone": METRICS,
    "skipped_images": 0,
}
# ... and as it writes it now, for a fine-tuning run with a frozen first stage.
CURRENT_FORMAT = {
    "loss": "angular",
    "mode": "finetune",
    "steps": 135,
    "stopped_early": True,
    "best_step": 100,
    "train_seconds": 2109.6,
    "val": METRICS,
    "val_backbone": METRICS,
    "beats_backbone": True,
    "validation_gain": Interval(0.1, 0.05, 0.15, 0.95, 2000).to_dict(),
    "test": METRICS,
    "test_backbone": METRICS,
    "skipped_images": 1,
    "frozen_stage": {
        "best_step": 2000,
        "steps": 2400,
        "train_seconds": 147.8,
        "val": METRICS,
        "beats_backbone": True,
    },
}


@pytest.mark.parametrize("written", [FIRST_FORMAT, CURRENT_FORMAT], ids=["first", "current"])
def test_a_summary_loads_and_is_written_back_byte_for_byte(tmp_path: Path, written: dict) -> None:
    run = RunDirectory(tmp_path)
    text = json.dumps(written, indent=2) + "\n"
    run.summary_path.write_text(text)
    summary = run.read_summary()
    assert isinstance(summary, RunSummary) and summary.best_step == written["best_step"]
    run.write_summary(summary)
    assert run.summary_path.read_text() == text


def test_an_old_summary_has_no_recorded_gain_and_says_what_it_lacks(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path)
    run.summary_path.write_text(json.dumps(FIRST_FORMAT))
    summary = run.read_summary()
    assert (summary.val_backbone, summary.beats_backbone, summary.validation_gain) == (None, None, None)
    with pytest.raises(RunDirError, match="recorded the untrained backbone"):
        summary.require_val_backbone()
    current = RunSummary.model_validate(CURRENT_FORMAT)
    assert current.validation_gain == Interval(0.1, 0.05, 0.15, 0.95, 2000)
    assert current.frozen_stage is not None and current.frozen_stage.steps == 2400


def test_a_damaged_summary_is_a_run_directory_error(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path)
    run.summary_path.write_text(json.dumps({"loss": "ms"}))
    with pytest.raises(RunDirError, match="summary"):
        run.read_summary()
