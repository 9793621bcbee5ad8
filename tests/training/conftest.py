"""Fixtures for the training tests: tiny labelled image folders and a shared feature cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from tests.conftest import make_image


def write_labelled_folder(root: Path, classes: int = 12, per_class: int = 5, size: int = 64) -> Path:
    """``root/class_XX/img_Y.png``: each class is one generated picture; its images are crops/tints of it."""
    for label in range(classes):
        base = make_image(1000 + label, (size + 16, size + 16))
        folder = root / f"class_{label:02d}"
        folder.mkdir(parents=True)
        rng = np.random.default_rng(label)
        for i in range(per_class):
            left, top = rng.integers(0, 16, size=2)
            image = base.crop((left, top, left + size, top + size))
            if i % 2:
                image = ImageOps.mirror(image)
            tint = Image.new("RGB", image.size, tuple(int(v) for v in rng.integers(0, 255, size=3)))
            Image.blend(image, tint, 0.15).save(folder / f"img_{i}.png")
    return root


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
