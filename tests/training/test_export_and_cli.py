"""Exporting a run to ONNX (parity with torch and with the frozen pipeline), evaluating it, and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from engine.build.indexing import build_index
from engine.decode.images import load_image_file
from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from tests.support.images import copy_with_truncated_jpeg
from tests.support.train_config import tiny_train_config
from training.backbone import create_backbone
from training.data import load_labelled_images
from training.evaluation import embed_run, evaluate_onnx
from training.export import export_run
from training.features import FeatureExtractor
from training.metrics import evaluate
from training.model import EmbeddingModel, build_objective
from training.run_dir import BestCheckpoint, RunDirectory
from training.trainer import train

runner = CliRunner()


@pytest.fixture(scope="module")
def trained_run(labelled_folder: Path, feature_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short frozen run whose best checkpoint then gets a non-zero residual MLP (so export covers it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    config = tiny_train_config(labelled_folder, feature_cache, max_steps=4, eval_every=2)
    train(config, out, progress=False)
    run = RunDirectory(out)
    best = run.require_best()
    generator = torch.Generator().manual_seed(0)
    for key in ("head.residual.2.weight", "head.residual.2.bias"):
        best.objective[key] = 0.05 * torch.randn(best.objective[key].shape, generator=generator)
    run.save_best(best)
    return out


@pytest.fixture(scope="module")
def exported_run(trained_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelCard]:
    """``trained_run`` exported once (model.onnx and its card), for the tests that read the export."""
    model_path = tmp_path_factory.mktemp("exported") / "model.onnx"
    return model_path, export_run(trained_run, model_path)


def _torch_model(run: Path) -> EmbeddingModel:
    config = RunDirectory(run).require_config()
    objective = build_objective(config, 1280)
    objective.load_state_dict(RunDirectory(run).require_best().objective)
    return EmbeddingModel(create_backbone(), objective.head).eval()


def test_exported_run_matches_torch_and_the_frozen_pipeline(
    trained_run: Path, exported_run: tuple[Path, ModelCard], labelled_folder: Path, feature_cache: Path
) -> None:
    model_path, card = exported_run
    assert card.embedding_dim == 16 and card.loss == "contrastive"
    assert card.extra["mode"] == "frozen" and "recall@1" in card.extra["val"]
    assert ModelCard.load(model_path).fingerprint == card.fingerprint

    files = load_labelled_images(labelled_folder).files()[:6]
    embedder = Embedder(model_path)
    images = [load_image_file(path) for path in files]
    exported = embedder.embed(images)
    with torch.no_grad():
        expected = _torch_model(trained_run)(torch.from_numpy(embedder.preprocess(images))).numpy()
    np.testing.assert_allclose(exported, expected, atol=2e-4)
    # The head trained on cached features computes the same embedding as the exported graph.
    features = FeatureExtractor(feature_cache, progress=False).extract(files).features
    objective = build_objective(RunDirectory(trained_run).require_config(), 1280)
    objective.load_state_dict(RunDirectory(trained_run).require_best().objective)
    with torch.no_grad():
        frozen = torch.nn.functional.normalize(objective.embed(torch.from_numpy(features)), dim=1).numpy()
    np.testing.assert_allclose(exported, frozen, atol=2e-4)


def test_exported_run_builds_an_index_and_evaluates_like_the_run(
    trained_run: Path, exported_run: tuple[Path, ModelCard], labelled_folder: Path, tmp_path: Path
) -> None:
    model_path, _ = exported_run
    report = build_index(labelled_folder, Embedder(model_path), tmp_path / "index", progress=False)
    assert report.indexed == 60
    from_onnx = evaluate_onnx(model_path, labelled_folder, progress=False)
    embedded = embed_run(trained_run, progress=False)  # the run's own embeddings, as its report scores them
    from_run = evaluate(embedded.trained, embedded.labels)
    assert from_onnx.keys() == from_run.keys()
    for name in ("recall@1", "recall@2", "map@r"):
        assert from_onnx[name] == pytest.approx(from_run[name], abs=1e-6)


def test_a_run_embeds_with_its_last_checkpoint_when_asked(trained_run: Path, tmp_path: Path) -> None:
    """``last=True`` embeds with checkpoints/last.pt (runs compared at the same step), not best.pt: the same
    embeddings as a copy of the run whose best checkpoint is its last one, and not the best's."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    run = RunDirectory(copy)
    last = run.require_last()
    run.save_best(BestCheckpoint(objective=last.objective, step=last.progress.step, val={}))
    with_last = embed_run(trained_run, progress=False, last=True).trained
    np.testing.assert_allclose(with_last, embed_run(copy, progress=False).trained, atol=1e-6)
    assert not np.allclose(with_last, embed_run(trained_run, progress=False).trained, atol=1e-4)


def test_truncated_jpeg_is_skipped_with_a_warning(
    labelled_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    data = tmp_path / "images"
    copy_with_truncated_jpeg(labelled_folder, data)
    config = tiny_train_config(data, feature_cache, max_steps=2, eval_every=2)
    with pytest.warns(UserWarning, match="skipped unreadable image .*broken.jpg"):
        summary = train(config, tmp_path / "run", progress=False)
    assert summary.skipped_images == 1


def test_cli_train_eval_export(labelled_folder: Path, feature_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--loss",
            "triplet",
            "--mode",  # else a CPU measures a fine-tuning step to choose one (tests/training/test_budget.py)
            "frozen",
            "--data",
            str(labelled_folder),
            "--out",
            str(out),
            "--cache-dir",
            str(feature_cache),
            "-p",
            "max_steps=3",
            "-p",
            "eval_every=3",
            "-p",
            "embedding_dim=16",
            "-p",
            "head-hidden=32",
            "-p",
            "margin=0.3",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "test        recall@1" in result.output
    beats = RunDirectory(out).read_summary().beats_backbone
    assert ("export it with" if beats else "NOT better than the untrained backbone") in result.output
    config = RunDirectory(out).require_config()
    assert config.loss_hparams == {"margin": 0.3} and config.max_steps == 3 and config.head_hidden == 32

    result = runner.invoke(app, ["eval", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert (
        json.loads(result.output)["trained"]["recall@1"] == RunDirectory(out).read_summary().test["recall@1"]
    )

    result = runner.invoke(app, ["export", str(out), "--force"])  # 3 steps may not beat the untrained model
    assert result.exit_code == 0, result.output
    assert Embedder(out / "model.onnx").dim == 16
    check = ModelCard.load(out / "model.onnx").validation_check  # a forced model says so in its card
    assert check.passed == beats and check.detail.startswith("validation recall@1")
    assert ("failed the validation check" in result.output) == (not beats)

    result = runner.invoke(
        app, ["eval", str(out / "model.onnx"), "--data", str(labelled_folder), "--split", "val"]
    )
    assert result.exit_code == 0 and "recall@1" in result.output, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--loss", "nope", "--data", "{data}", "--out", "{out}"], "unknown loss 'nope'"),
        (["train", "--loss", "ms", "--data", "{out}/missing", "--out", "{out}"], "does not exist"),
        (
            ["train", "--loss", "ms", "--data", "{data}", "--out", "{out}", "-p", "speed=9"],
            "unknown hyperparameter",
        ),
        (
            ["train", "--loss", "ms", "--data", "{data}", "--out", "{out}", "-p", "lr=-1"],
            "invalid training setting",
        ),
        (
            ["train", "--loss", "ms", "--data", "{data}", "--out", "{out}", "--train-classes", "40"],
            "between 1 and 11",
        ),
        (["eval", "{out}"], "not a training run"),
        (["eval", "{data}/class_00/img_0.png"], "neither a run directory nor a .onnx"),
        (["export", "{out}"], "not a training run"),
    ],
)
def test_cli_bad_input_exits_2(labelled_folder: Path, tmp_path: Path, args: list[str], message: str) -> None:
    filled = [arg.format(data=labelled_folder, out=tmp_path) for arg in args]
    result = runner.invoke(app, filled)
    assert result.exit_code == 2
    assert message in result.output


def test_cli_export_without_a_run_still_exports_the_pretrained_backbone(tmp_path: Path) -> None:
    result = runner.invoke(app, ["export", "--out", str(tmp_path / "m" / "model.onnx")])
    assert result.exit_code == 0, result.output
    card = ModelCard.load(tmp_path / "m" / "model.onnx")
    assert card.embedding_dim == 1280 and card.head == "none"
