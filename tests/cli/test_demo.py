"""``make demo`` (``dmlsearch demo``) after a user indexed their own photos: nothing of theirs is touched."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.images import make_image
from engine.build.indexing import build_index
from engine.model.embedder import Embedder
from foundation import defaults
from index.manifest import Manifest
from tests.support.served import index_digest

REPO = Path(__file__).resolve().parents[2]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow  # the whole demo setup (export, gallery, index) in a CLI process
def test_the_demo_never_touches_the_users_model_or_index(
    tmp_path: Path, demo_gallery: Path, exported_model: Path
) -> None:
    # The user's own setup, as "Using it" makes it, relative to where make runs.
    photos = tmp_path / "photos"
    (photos / "hummer").mkdir(parents=True)
    for i in range(3):
        make_image(i, size=(64, 56)).save(photos / "hummer" / f"IMG_{i}.png")
    model, index = tmp_path / defaults.MODEL_PATH, tmp_path / defaults.INDEX_PATH
    shutil.copytree(exported_model.parent, model.parent)  # model.onnx, its card and its explainer
    build_index(photos, Embedder(model, threads=1), index, progress=False)
    index_before, model_before = index_digest(index), _digest(model)
    # A few demo photos already in place: the demo's build is not what is tested.
    demo_photos = tmp_path / defaults.DEMO_DIR / "gallery"
    demo_photos.mkdir(parents=True)
    for path in sorted(demo_gallery.rglob("*.jpg"))[:4]:
        shutil.copy(path, demo_photos / path.name)

    demo = subprocess.run(
        [sys.executable, "-m", "cli.main", "demo", "--no-serve"],  # what `make demo` runs, minus serving
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "indexed 4 images into artifacts/demo/index" in demo.stdout
    assert (index_digest(index), _digest(model)) == (index_before, model_before)
    assert Manifest.load(index).gallery_root == str(photos.resolve())
    assert Manifest.load(tmp_path / defaults.DEMO_DIR / "index").gallery_root == str(demo_photos.resolve())
