"""Training without labels: a flat folder through the CLI, a partly labelled folder, byte copies, and the
gate on the label-free score."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from engine.model.embedder import Embedder
from tests.support.train_config import tiny_train_config
from training.data import LOOSE
from training.label_free_data import is_label_free, label_free_images, plan_label_free
from training.trainer import prepare_data

runner = CliRunner()
TINY = ["-p", "embedding_dim=16", "-p", "head_hidden=32"]


def _train(flat: Path, out: Path, cache: Path, *extra: str) -> None:
    command = ["train", "--loss", "contrastive", "--data", str(flat), "--out", str(out), "--mode", "frozen"]
    result = runner.invoke(app, [*command, "--cache-dir", str(cache), *TINY, *extra])
    assert result.exit_code == 0, result.output
    assert "without labels: 48 photos pseudo-labelled (0 labelled)" in result.output


def test_a_flat_folder_trains_without_labels_and_its_run_evaluates_reports_and_exports(
    flat_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    _train(flat_folder, out, feature_cache, "-p", "max_steps=110", "-p", "eval_every=55")
    summary = json.loads((out / "summary.json").read_text())
    record = summary["label_free"]
    assert (record["loose_photos"], record["labelled_photos"]) == (48, 0)
    assert record["held_out_photos"] == {"val": 6, "test": 6}
    assert [refresh["step"] for refresh in record["refreshes"]] == [0, 100]  # k-means again at step 100
    assert all(sum(refresh["sizes"]) == 48 for refresh in record["refreshes"])
    assert summary["steps"] == 110 and "val_backbone" in summary and "validation_gain" in summary
    config = json.loads((out / "config.json").read_text())
    assert config["views"] == 4 and config["labels"] == "folders"

    evaluated = runner.invoke(app, ["eval", str(out)])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads((out / "eval.json").read_text())["images"] == 12  # 6 photos, each with one view
    reported = runner.invoke(app, ["report", str(out)])
    assert reported.exit_code == 0, reported.output
    page = (out / "report.html").read_text()
    assert "<img alt='pseudo_labels'" in page and "held-out photos" in page
    exported = runner.invoke(app, ["export", str(out), "--force"])
    assert exported.exit_code == 0, exported.output
    assert Embedder(out / "model.onnx").card.embedding_dim == 16


def test_labels_none_ignores_class_folders(labelled_folder: Path) -> None:
    assert not is_label_free(labelled_folder, "folders")
    images = label_free_images(labelled_folder, "none")
    assert images is not None and (images.labels == LOOSE).all() and len(images) == 60


def test_the_gate_refuses_a_checkpoint_whose_label_free_score_is_not_better(
    flat_folder: Path, feature_cache: Path, tmp_path: Path
) -> None:
    # A learning rate that moves no ranking: every validation scores what step 0 scored, so no trained
    # step is better on the held-out photos and the untrained model stays the one to serve.
    out = tmp_path / "run"
    _train(flat_folder, out, feature_cache, "-p", "max_steps=20", "-p", "eval_every=10", "-p", "lr=1e-12")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len({record["val"]["recall@1"] for record in metrics}) == 1 and len(metrics) == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_step"] == 0 and summary["beats_backbone"] is False
    refused = runner.invoke(app, ["export", str(out)])
    assert refused.exit_code == 2 and "not better than the untrained model" in refused.output
    assert not (out / "model.onnx").exists()


@pytest.fixture(scope="module")
def partly_labelled(labelled_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 class folders (20 photos), 40 loose photos, a loose byte copy of a labelled photo and a loose
    byte copy of a loose one."""
    root = tmp_path_factory.mktemp("partly") / "photos"
    for path in sorted(labelled_folder.rglob("*.png")):
        if path.parent.name < "class_04":
            (root / path.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, root / path.parent.name / path.name)
        else:
            root.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, root / f"{path.parent.name}_{path.name}")
    shutil.copy(root / "class_00" / "img_0.png", root / "copy_of_labelled.png")
    shutil.copy(root / "class_05_img_1.png", root / "copy_of_loose.png")
    return root


def test_a_partly_labelled_folder_keeps_its_labels_and_merges_byte_copies(
    partly_labelled: Path, feature_cache: Path
) -> None:
    images = label_free_images(partly_labelled, "folders")
    assert images is not None
    plan = plan_label_free(images, seed=0)
    index = {path: i for i, path in enumerate(plan.images.paths)}
    labelled_copy, loose_copy = index["copy_of_labelled.png"], index["copy_of_loose.png"]
    assert (
        plan.images.labels[labelled_copy] == plan.images.labels[index["class_00/img_0.png"]] == 0
    )  # a real label wins
    assert plan.copies[loose_copy] == plan.copies[index["class_05_img_1.png"]]
    for split in (plan.train, plan.val, plan.test):  # copies never straddle the split
        assert np.isin(loose_copy, split) == np.isin(index["class_05_img_1.png"], split)
    held_out = np.concatenate([plan.val, plan.test])
    assert (plan.images.labels[held_out] == LOOSE).all()  # only loose photos are held out

    data = prepare_data(
        tiny_train_config(partly_labelled, feature_cache, views=1), feature_cache, progress=False
    )
    train = data.labels("train")
    assert sorted(np.unique(train[train != LOOSE])) == [0, 1, 2, 3]
    assert (train != LOOSE).sum() == 21  # 20 in class folders and the copy of one of them
    val = data.labels("val")
    assert (val[: len(val) // 2] == val[len(val) // 2 :]).all()  # a held-out photo and its view: one id
