"""Fixtures for the training tests: tiny labelled image folders and a shared feature cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import write_labelled_folder


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
