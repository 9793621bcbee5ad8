"""The frozen-mode training loop: run directory, validation-based selection, resume, bad data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.train_config import tiny_train_config
from training.config import TrainConfig
from training.metrics import evaluate
from training.run_dir import RunDirectory, RunDirError
from training.trainer import prepare_data, train


def _config(data: Path, cache: Path, **overrides: Any) -> TrainConfig:
    return tiny_train_config(data, cache, **{"max_steps": 12, "eval_every": 4, "patience": 100, **overrides})


def test_frozen_run_writes_a_complete_run_directory(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    summary = train(_config(labelled_folder, feature_cache), out, progress=False)
    run = RunDirectory(out)
    records = run.read_metrics()
    assert [record["step"] for record in records] == [0, 4, 8, 12]
    assert all(0.0 <= record["val"]["recall@1"] <= 1.0 for record in records)
    assert records[0]["train_loss"] is None and records[1]["train_loss"] > 0
    # The kept model is the first step with the best validation Recall@1, step 0 included.
    scores = [record["val"]["recall@1"] for record in records]
    best = run.require_best()
    assert best.step == records[scores.index(max(scores))]["step"] == summary.best_step
    assert summary.val == best.val
    # Beating the backbone means better by the paired bootstrap interval on validation, not just higher.
    gain = summary.validation_gain
    assert gain.low <= gain.difference <= gain.high
    observed = summary.val["recall@1"] - summary.val_backbone["recall@1"]
    assert gain.difference == pytest.approx(observed)
    assert summary.beats_backbone == (summary.best_step > 0 and gain.verdict == "better")
    assert set(summary.test) == {"recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi", "f1"}
    # The config as given, plus what the run computed with (frozen: the head alone, in float32).
    compute = {"device": "cpu", "precision": "fp32", "channels_last": False}
    saved = run.read_config()
    assert saved.model_copy(update={"compute": None}) == _config(labelled_folder, feature_cache)
    assert {key: saved.compute[key] for key in compute} == compute
    assert json.loads(run.summary_path.read_text()) == summary.to_dict()
    assert run.load_last().progress.step == 12
    assert not list(out.rglob("*.tmp")), "no temporary files left behind"


def test_interrupted_run_resumes_to_the_same_weights(
    labelled_folder: Path,
    feature_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _config(labelled_folder, feature_cache)
    train(config, tmp_path / "straight", progress=False)

    from training.samplers import ClassBalancedSampler

    calls = {"n": 0}
    original = ClassBalancedSampler.after_step

    def crash_at_step_7(self, indices, loss) -> None:  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        original(self, indices, loss)

    monkeypatch.setattr(ClassBalancedSampler, "after_step", crash_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "resumed", progress=False)
    assert RunDirectory(tmp_path / "resumed").load_last().progress.step == 4
    monkeypatch.setattr(ClassBalancedSampler, "after_step", original)
    capsys.readouterr()
    train(config, tmp_path / "resumed", progress=True)
    assert f"resuming from step 4 of {config.max_steps} (" in capsys.readouterr().out

    straight = RunDirectory(tmp_path / "straight").load_last().objective
    resumed = RunDirectory(tmp_path / "resumed").load_last().objective
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    assert (
        RunDirectory(tmp_path / "resumed").read_metrics()
        == RunDirectory(tmp_path / "straight").read_metrics()
    )


def test_a_run_directory_refuses_a_different_config(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    train(_config(labelled_folder, feature_cache, max_steps=4), out, progress=False)
    with pytest.raises(RunDirError, match="lr"):
        train(_config(labelled_folder, feature_cache, max_steps=4, lr=1e-3), out, progress=False)
    # More steps is a continuation, not a conflict.
    summary = train(_config(labelled_folder, feature_cache, max_steps=8), out, progress=False)
    assert summary.steps == 8


def test_magnet_trains_on_neighbourhood_batches_with_a_refreshed_cluster_index(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    config = _config(
        labelled_folder,
        feature_cache,
        loss="magnet",
        max_steps=7,
        eval_every=7,
        cluster_refresh=3,
        clusters_per_class=2,
        classes_per_batch=4,
        samples_per_class=2,
    )
    summary = train(config, tmp_path / "run", progress=False)
    sampler = RunDirectory(tmp_path / "run").load_last().sampler
    assert int(sampler["refreshes"]) == 3  # before steps 0, 3 and 6
    # 4 training classes of 5 images: none fills 2 clusters of 2 x D = 4 (training.recipes.magnet_clusters)
    assert len(sampler["centres"]) == 4
    assert torch.isfinite(sampler["example_losses"]).any(), "the loss fed per-example losses back"
    assert summary.steps == 7


def test_augmented_views_are_cached_reproducible_and_differ_from_the_serving_view(
    labelled_folder: Path, feature_cache: Path
) -> None:
    from training.trainer import prepare_data

    config = _config(labelled_folder, feature_cache, views=2)
    first = prepare_data(config, feature_cache, progress=False)
    assert first.train_views.shape == (3, len(first.indices["train"]), 1280)
    np.testing.assert_array_equal(first.train_views[0], first.features["train"])
    assert not np.allclose(first.train_views[1], first.train_views[0], atol=1e-3)
    assert not np.allclose(first.train_views[1], first.train_views[2], atol=1e-3)
    again = prepare_data(config, feature_cache, progress=False)
    np.testing.assert_array_equal(again.train_views, first.train_views)
    reseeded = prepare_data(config.model_copy(update={"seed": 1}), feature_cache, progress=False)
    assert not np.allclose(reseeded.train_views[1], first.train_views[1], atol=1e-3)


@pytest.mark.parametrize(("min_steps", "stop_step"), [(0, 4), (10, 12)])
def test_early_stopping_waits_for_min_steps(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path, min_steps: int, stop_step: int
) -> None:
    # At lr 1e-12 validation never improves on step 0, so patience 1 stops at the first validation that
    # min_steps allows: step 4 without it, the first validation at or after step 10 with it.
    config = _config(labelled_folder, feature_cache, lr=1e-12, patience=1, max_steps=40, min_steps=min_steps)
    summary = train(config, tmp_path / "run", progress=False)
    assert summary.stopped_early and summary.steps == stop_step and summary.best_step == 0


def test_view_seed_shares_augmented_views_across_run_seeds(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(feature_cache / "backbones", cache / "backbones")  # the model, none of the features
    features = cache / "features"
    train(_config(labelled_folder, cache, views=1, max_steps=2, eval_every=2), tmp_path / "a", progress=False)
    extracted = set(features.iterdir())
    shared = _config(labelled_folder, cache, views=1, max_steps=2, eval_every=2, seed=1, view_seed=0)
    train(shared, tmp_path / "b", progress=False)
    assert set(features.iterdir()) == extracted  # seed 1 read seed 0's crops
    own = _config(labelled_folder, cache, views=1, max_steps=2, eval_every=2, seed=1)
    train(own, tmp_path / "c", progress=False)
    assert len(set(features.iterdir()) - extracted) == 1  # without view_seed, seed 1 crops its own view


def test_the_raw_backbone_validation_baseline_is_recorded(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    # At lr 1e-12 no step can beat step 0; whether step 0 beats the raw features is what the record says.
    config = _config(labelled_folder, feature_cache, lr=1e-12, max_steps=4)
    with pytest.warns(UserWarning, match="not better than the untrained backbone's own features"):
        summary = train(config, tmp_path / "run", progress=False)
    data = prepare_data(config, feature_cache, progress=False)
    raw = evaluate(data.features["val"], data.labels("val"), seed=config.seed)
    records = RunDirectory(tmp_path / "run").read_metrics()
    assert records[0]["val_backbone"] == summary.val_backbone == raw
    assert summary.best_step == 0 and summary.beats_backbone is False
    assert summary.test_backbone == evaluate(data.features["test"], data.labels("test"), seed=config.seed)
