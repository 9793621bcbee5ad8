"""Finetune mode on CPU: the backbone trains at a tenth of the head's learning rate, batch norm frozen;
the loss stays in float32 under the mixed precision used on GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import tiny_train_config, write_labelled_folder
from training.backbone import create_backbone
from training.heads import ResidualHead
from training.losses import build_loss
from training.model import TrainingObjective
from training.run_dir import RunDirectory
from training.trainer import train


def test_finetune_trains_the_backbone_slowly_and_keeps_batch_norm_statistics(
    feature_cache: Path, tmp_path: Path
) -> None:
    data = write_labelled_folder(tmp_path / "images", classes=8, per_class=3, size=48)
    config = tiny_train_config(
        data,
        feature_cache,
        mode="finetune",
        max_steps=2,
        eval_every=2,
        embedding_dim=8,
        head_hidden=16,
        lr=1e-3,
        classes_per_batch=2,
        samples_per_class=2,
        workers=0,
        eval_batch_size=8,
    )
    summary = train(config, tmp_path / "run", progress=False)
    assert summary["mode"] == "finetune" and summary["steps"] == 2

    last = RunDirectory(tmp_path / "run").load_checkpoint("last")
    groups = last["optimizer"]["param_groups"]
    assert [group["lr"] for group in groups] == [1e-3, 1e-4]
    pretrained = create_backbone().state_dict()
    trained = {
        key.removeprefix("backbone."): value
        for key, value in last["objective"].items()
        if key.startswith("backbone.")
    }
    assert trained.keys() == pretrained.keys()
    changed = [key for key in pretrained if not torch.equal(trained[key], pretrained[key])]
    assert any(key.endswith("weight") for key in changed), "backbone weights trained"
    assert not [key for key in changed if "running_" in key], "batch-norm statistics stay frozen"


@pytest.mark.parametrize("loss", ["ms", "angular", "pddm"])
def test_losses_run_in_float32_under_mixed_precision(loss: str) -> None:
    """The training step's autocast stops at the loss (CPU bfloat16 stands in for CUDA here): with it on,
    the pair losses' custom Gram backward met a bfloat16 gradient and float32 inputs and failed."""
    torch.manual_seed(0)
    hparams = {"embedding_dim": 8} if loss == "pddm" else {}
    objective = TrainingObjective(nn.Linear(12, 10), ResidualHead(10, 8, 16), build_loss(loss, **hparams))
    labels = torch.arange(4).repeat_interleave(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = objective(torch.randn(16, 12), labels)
    value.backward()
    assert value.dtype == torch.float32 and torch.isfinite(value)
    assert all(torch.isfinite(p.grad).all() for p in objective.parameters() if p.grad is not None)
