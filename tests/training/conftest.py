"""Fixtures for the training tests: tiny labelled image folders, a shared feature cache, an index with
judgments."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.lib.images import write_labelled_folder
from bench.lib.simulated_user import index_gallery, judge_top
from training.data import load_labelled_images


@pytest.fixture(scope="session")
def labelled_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 classes x 5 images (6 train classes, of which 2 for validation; 6 test classes); read-only."""
    return write_labelled_folder(tmp_path_factory.mktemp("labelled") / "images")


@pytest.fixture(scope="session")
def feature_cache(tmp_path_factory: pytest.TempPathFactory, exported_model: Path) -> Path:
    """A feature cache whose backbone is the session's exported pretrained model (saves an export)."""
    cache = tmp_path_factory.mktemp("feature_cache")
    target = cache / "backbones" / "efficientnet_lite0"
    target.mkdir(parents=True)
    shutil.copy(exported_model, target / "model.onnx")
    shutil.copy(exported_model.with_suffix(".json"), target / "model.json")
    return cache


@pytest.fixture(scope="session")
def flat_folder(labelled_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The labelled folder's 60 images side by side in one folder, with no class folder; read-only."""
    root = tmp_path_factory.mktemp("flat") / "photos"
    root.mkdir()
    for path in sorted(labelled_folder.rglob("*.png")):
        shutil.copy(path, root / f"{path.parent.name}_{path.name}")
    return root


@pytest.fixture(scope="session")
def partly_judged_index(
    labelled_folder: Path, feature_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The labelled folder indexed, 8 queries' top 5 judged by class: some photos nobody judged."""
    images = load_labelled_images(labelled_folder)
    directory = tmp_path_factory.mktemp("partly") / "index"
    labels = [images.class_names[label] for label in images.labels]
    index_gallery(labelled_folder, images.files(), labels, directory, feature_cache)
    assert judge_top(directory, [1, 8, 15, 22, 29, 36, 43, 50], top=5) == 40
    return directory
