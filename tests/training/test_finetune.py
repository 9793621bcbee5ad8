"""Finetune mode on CPU: the backbone trains at a tenth of the head's learning rate, batch norm frozen;
the loss stays in float32 under the mixed precision used on GPUs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bench.lib.images import write_labelled_folder
from tests.support.train_config import tiny_train_config
from training.backbone import BACKBONES, create_backbone
from training.heads import ResidualHead
from training.losses import build_loss
from training.model import TrainingObjective
from training.run_dir import RunDirectory
from training.samplers import ClassBalancedSampler
from training.trainer import frozen_stage, train
from training.workloads import FinetuneWorkload


@pytest.mark.slow  # a real fine-tuning run on the CPU
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
    assert summary.mode == "finetune" and summary.steps == 2

    last = RunDirectory(tmp_path / "run").load_last()
    groups = last.optimizer["param_groups"]
    assert [group["lr"] for group in groups] == [1e-3, 1e-4]
    pretrained = create_backbone().state_dict()
    trained = {
        key.removeprefix("backbone."): value
        for key, value in last.objective.items()
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


def test_train_size_makes_smaller_training_crops_and_evaluation_keeps_the_input_size(tmp_path: Path) -> None:
    """train_size shrinks the augmented training crops only: validation, test and export see whole images
    at the backbone's input size."""
    data = write_labelled_folder(tmp_path / "images", classes=4, per_class=2, size=48)
    files = sorted(data.rglob("*.png"))
    objective = TrainingObjective(create_backbone(), ResidualHead(1280, 8, 16), build_loss("contrastive"))
    preprocessing = BACKBONES["efficientnet_lite0"].preprocessing
    workload = FinetuneWorkload(
        objective,
        {"train": files, "val": files[:4]},
        preprocessing,
        torch.device("cpu"),
        workers=0,
        batch_size=4,
        train_size=96,
    )
    sampler = ClassBalancedSampler(np.repeat(np.arange(4), 2), classes=2, samples_per_class=2, seed=0)
    _, inputs = next(workload.batches(sampler, np.random.default_rng(0)))
    assert inputs.shape == (4, 3, 96, 96)
    assert workload.preprocessing.input_size == preprocessing.input_size == 224  # evaluation: unchanged
    assert workload.embed("val").shape == (4, 8)


@pytest.mark.slow  # a real fine-tuning run on the CPU
def test_frozen_first_fine_tunes_from_the_head_the_frozen_mode_trained(
    feature_cache: Path, tmp_path: Path
) -> None:
    data = write_labelled_folder(tmp_path / "images", classes=8, per_class=3, size=48)
    settings = {
        "mode": "finetune",
        "frozen_first": True,
        "eval_every": 1,
        "embedding_dim": 8,
        "head_hidden": 16,
        "lr": 1e-2,
        "classes_per_batch": 2,
        "samples_per_class": 2,
        "workers": 0,
        "eval_batch_size": 8,
        "train_size": 64,
    }
    out = tmp_path / "run"
    first = frozen_stage(tiny_train_config(data, feature_cache, max_steps=0, **settings), out, progress=False)
    stage = RunDirectory(out / "frozen-stage")
    stage_config = stage.require_config()
    assert (stage_config.mode, stage_config.max_steps, stage_config.frozen_first) == ("frozen", 3000, False)
    assert first.summary.steps > 0, "the frozen stage trained"
    # Whatever the stage's best.pt holds is where fine-tuning starts: mark it to recognise it.
    best = stage.require_best()
    best.objective["head.projection.weight"] += 0.5
    stage.save_best(best)

    # max_steps=0: the fine-tuning run only validates where it starts, so its best.pt is its start.
    summary = train(tiny_train_config(data, feature_cache, max_steps=0, **settings), out, progress=False)
    assert summary.frozen_stage.best_step == best.step
    started = RunDirectory(out).require_best().objective
    stage_head = {key: value for key, value in best.objective.items() if key.startswith("head.")}
    assert stage_head and all(torch.equal(started[key], value) for key, value in stage_head.items())

    # Continuing the run fine-tunes from there; the stage is not trained again.
    modified = (out / "frozen-stage" / "summary.json").stat().st_mtime_ns
    longer = train(tiny_train_config(data, feature_cache, max_steps=1, **settings), out, progress=False)
    assert longer.steps == 1 and longer.frozen_stage == summary.frozen_stage
    assert (out / "frozen-stage" / "summary.json").stat().st_mtime_ns == modified
