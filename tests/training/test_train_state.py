"""The trainer's pieces that need no run: its progress record (its precision: test_precision.py)."""

from __future__ import annotations

import math
from dataclasses import asdict

from training.trainer import TrainState


def test_train_state_round_trips_through_a_checkpoint_dict() -> None:
    state = TrainState(step=7, best_step=4, best_score=0.5, since_best=1, stopped=True, elapsed=2.5)
    checkpoint = {**asdict(state), "objective": {}, "optimizer": {}}  # last.pt keeps both side by side
    assert TrainState.from_checkpoint(checkpoint) == state
    fresh = TrainState()
    assert (fresh.step, fresh.best_score, fresh.stopped) == (0, -math.inf, False)
