"""Partial mode: the backbone's last stage trains on cached maps entering it, and exports as one graph."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.decode.images import load_image_file
from engine.model.embedder import Embedder
from tests.support.train_config import tiny_train_config
from training.backbone import create_backbone, split_backbone
from training.data import load_labelled_images
from training.export import export_run
from training.features import FeatureExtractor
from training.model import build_objective
from training.run_dir import RunDirectory
from training.trainer import prepare_data, train


def test_trunk_then_last_stage_is_the_backbone() -> None:
    backbone = create_backbone()
    trunk, last_stage = split_backbone("efficientnet_lite0", backbone)
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(last_stage(trunk(images)), backbone(images), rtol=0, atol=0)
    assert {id(p) for p in last_stage.parameters()} <= {id(p) for p in backbone.parameters()}


@pytest.mark.slow  # trains the backbone's last stage on the CPU
def test_partial_run_trains_the_last_stage_only_and_exports_it(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = tiny_train_config(
        labelled_folder, feature_cache, mode="partial", views=1, max_steps=3, eval_every=3, lr=1e-2
    )
    data = prepare_data(config, feature_cache, progress=False)
    assert data.train_views.shape == (2, len(data.indices["train"]), 192, 7, 7)
    assert data.train_views.dtype == np.float16 and data.features["train"].shape[1] == 1280
    # The cached maps, through the pretrained last stage, give the cached pooled features.
    _, last_stage = split_backbone("efficientnet_lite0", create_backbone())
    with torch.no_grad():
        pooled = last_stage(torch.from_numpy(data.inputs["val"]).float())
    np.testing.assert_allclose(
        torch.nn.functional.normalize(pooled, dim=1).numpy(), data.features["val"], atol=2e-3
    )

    out = tmp_path / "run"
    summary = train(config, out, progress=False)
    assert summary.mode == "partial" and summary.steps == 3
    run = RunDirectory(out)
    last = run.load_last()
    assert [group["lr"] for group in last.optimizer["param_groups"]] == [1e-2, 1e-3]
    pretrained = last_stage.state_dict()
    objective_weights = last.objective.items()
    trained = {k.removeprefix("backbone."): v for k, v in objective_weights if k.startswith("backbone.")}
    assert trained.keys() == pretrained.keys()
    changed = [key for key in pretrained if not torch.equal(trained[key], pretrained[key])]
    assert any(key.endswith("weight") for key in changed), "the last stage trained"
    assert not [key for key in changed if "running_" in key], "batch-norm statistics stay frozen"

    # Export the last checkpoint: backbone with the trained last stage + head in one graph, equal to the
    # objective run on the cached maps (float16 storage is the only difference).
    run.save_best(replace(run.require_best(), objective=last.objective))
    model_path = tmp_path / "model.onnx"
    card = export_run(out, model_path)
    assert card.extra["mode"] == "partial"
    files = load_labelled_images(labelled_folder).files()[:5]
    exported = Embedder(model_path).embed([load_image_file(path) for path in files])
    maps = FeatureExtractor(feature_cache, stage="trunk", progress=False).extract(files).features
    objective = build_objective(config, 1280)
    objective.load_state_dict(last.objective)
    with torch.no_grad():
        cached = objective.eval().embed(torch.from_numpy(maps).float())
    np.testing.assert_allclose(exported, torch.nn.functional.normalize(cached, dim=1).numpy(), atol=5e-3)
