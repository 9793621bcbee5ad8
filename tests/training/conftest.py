"""Fixtures for the training tests: tiny labelled image folders and a shared feature cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.lib.images import write_labelled_folder


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
