"""The trainer's pieces that need no run: its progress record and its mixed-precision decision."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch

from training.trainer import TrainState, mixed_precision


def test_train_state_round_trips_through_a_checkpoint_dict() -> None:
    state = TrainState(step=7, best_step=4, best_score=0.5, since_best=1, stopped=True, elapsed=2.5)
    checkpoint = {**asdict(state), "objective": {}, "optimizer": {}}  # last.pt keeps both side by side
    assert TrainState.from_checkpoint(checkpoint) == state
    fresh = TrainState()
    assert (fresh.step, fresh.best_score, fresh.stopped) == (0, -math.inf, False)


@pytest.mark.parametrize(
    ("amp", "device", "bf16", "expected"),
    [
        (True, "cpu", True, None),  # mixed precision is for GPUs only
        (False, "cuda", True, None),
        (True, "cuda", True, torch.bfloat16),
        (True, "cuda", False, torch.float16),  # older GPUs: float16, with a gradient scaler
    ],
)
def test_mixed_precision_is_decided_once(
    amp: bool, device: str, bf16: bool, expected: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    assert mixed_precision(amp, torch.device(device)) == expected
