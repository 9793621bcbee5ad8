"""One staged write (``index.staging``): ``build-index`` of a new index or with a new model, ``index
rebuild`` and ``index merge`` killed with SIGKILL after each step of the commit leave at the target the old
index (or none) or the new complete one, always with its model, and a rerun finishes the job.

Each kill runs the real command in a child process that wraps one step of ``StagedIndex.commit`` so that the
process kills itself (SIGKILL, nothing cleaned up) right after that step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.lib.images import export_small_model, write_labelled_folder
from engine.model.bundle import stored_model
from engine.model.model_card import ModelCard
from index.gallery import GalleryIndex
from index.manifest import Manifest
from index.staging import staging_directory

# After which step of the commit the child kills itself: the owner of the step, as the child sees it.
STEPS = {
    "build": "index.gallery:GalleryIndex.build",
    "model": "index.gallery:GalleryIndex.store_model",
    "save": "index.gallery:GalleryIndex.save",
    "exchange": "index.staging:_exchange",  # the old and new directories swapped, the old one not yet removed
    "swap": "index.staging:swap_in",
}
# Wraps STEPS[step] while StagedIndex.commit runs, then runs the command line (cli.main) as usual.
CHILD = """
import os, signal, sys
import importlib
from index import staging

module_name, qualified = sys.argv[1].split(":")
owner_name, _, name = qualified.rpartition(".")
module = importlib.import_module(module_name)
owner = getattr(module, owner_name) if owner_name else module
real_step = getattr(owner, name)

def step_then_die(*args, **kwargs):
    result = real_step(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
    return result

real_commit = staging.StagedIndex.commit

def commit(self, *args, **kwargs):
    setattr(owner, name, step_then_die)
    return real_commit(self, *args, **kwargs)

staging.StagedIndex.commit = commit
sys.argv = ["dmlsearch", *sys.argv[2:]]
from cli.main import app
app()
"""


# Each test kills real CLI processes at each step of a write: a process start each, about 60 s of CPU in all.
pytestmark = pytest.mark.slow


def _run(*args: object, kill_after: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [str(a) for a in args] + ["--no-progress"]
    if kill_after is None:
        command = [sys.executable, "-m", "cli.main", *argv]
    else:
        command = [sys.executable, "-c", CHILD, STEPS[kill_after], *argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def _complete(directory: Path) -> str:
    """The model fingerprint of the complete, searchable index at ``directory``, which carries its model."""
    manifest = Manifest.load(directory)
    model = stored_model(directory, manifest)
    assert model is not None, f"{directory} carries no model"
    assert ModelCard.load(model).fingerprint == manifest.model_fingerprint, "the index holds another model"
    index = GalleryIndex.open(directory)
    try:
        assert len(index) == manifest.count > 0
        hits = index.search(np.ones((1, manifest.dim), np.float32), 3)
        assert len(hits[0]) == 3
    finally:
        index.close()
    return manifest.model_fingerprint


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("staged-models")
    return (
        export_small_model(root / "old" / "model.onnx", seed=1),
        export_small_model(root / "new" / "model.onnx", seed=2, dim=16),
    )


@pytest.fixture(scope="module")
def gallery(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_labelled_folder(tmp_path_factory.mktemp("staged") / "gallery", classes=3, per_class=4)


def _fingerprint(model: Path) -> str:
    return ModelCard.load(model).fingerprint


def _killed(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr


@pytest.mark.parametrize("step", ["build", "model", "save", "swap"])
def test_the_first_build_index_killed_at_each_step(
    step: str, models: tuple[Path, Path], gallery: Path, tmp_path: Path
) -> None:
    old, _ = models
    out = tmp_path / "index"
    _killed(_run("build-index", gallery, "--model", old, "--out", out, kill_after=step))
    if step == "swap":
        assert _complete(out) == _fingerprint(old)
    else:
        assert not out.exists()  # no index yet, not one without its model or search structure
        assert staging_directory(out).exists()  # the staged copy, continued by the rerun
    finished = _run("build-index", gallery, "--model", old, "--out", out)
    assert finished.returncode == 0, finished.stderr
    assert _complete(out) == _fingerprint(old)
    assert not staging_directory(out).exists()


@pytest.mark.parametrize("step", ["build", "model", "save", "exchange", "swap"])
def test_build_index_with_a_new_model_killed_at_each_step(
    step: str, models: tuple[Path, Path], gallery: Path, tmp_path: Path
) -> None:
    old, new = models
    out = tmp_path / "index"
    assert _run("build-index", gallery, "--model", old, "--out", out).returncode == 0
    _killed(_run("build-index", gallery, "--model", new, "--out", out, kill_after=step))
    # Before the swap the old index is there, from the exchange on the new one: complete either way.
    expected = _fingerprint(new) if step in ("exchange", "swap") else _fingerprint(old)
    assert _complete(out) == expected
    finished = _run("build-index", gallery, "--model", new, "--out", out)
    assert finished.returncode == 0, finished.stderr
    assert _complete(out) == _fingerprint(new)
    assert not staging_directory(out).exists()  # nor the old index a kill after the exchange left there


@pytest.mark.parametrize("step", ["build", "model", "save", "swap"])
def test_index_rebuild_killed_at_each_step(
    step: str, models: tuple[Path, Path], gallery: Path, tmp_path: Path
) -> None:
    old, new = models
    index, out = tmp_path / "index", tmp_path / "new"
    assert _run("build-index", gallery, "--model", old, "--out", index).returncode == 0
    _killed(_run("index", "rebuild", index, "--model", new, "--out", out, kill_after=step))
    if step == "swap":  # swapped in: done, and the rerun refuses to overwrite it
        assert _complete(out) == _fingerprint(new)
        assert _run("index", "rebuild", index, "--model", new, "--out", out).returncode == 2
    else:
        assert not out.exists()  # no index yet, not one without its model
        assert staging_directory(out).exists()  # the staged copy, continued by the rerun
        finished = _run("index", "rebuild", index, "--model", new, "--out", out)
        assert finished.returncode == 0, finished.stderr
        assert "already re-embedded" in finished.stdout
        assert _complete(out) == _fingerprint(new)
    assert _complete(index) == _fingerprint(old)  # the source is never written to


@pytest.mark.parametrize("step", ["build", "model", "save", "exchange", "swap"])
def test_index_merge_killed_at_each_step(
    step: str, models: tuple[Path, Path], gallery: Path, tmp_path: Path
) -> None:
    old, _ = models
    shards = [tmp_path / "shard0", tmp_path / "shard1"]
    for number, shard in enumerate(shards):
        built = _run("build-index", gallery, "--model", old, "--out", shard, "--shard", f"{number}/2")
        assert built.returncode == 0, built.stderr
    out = tmp_path / "merged"
    assert _run("index", "merge", *shards, "--out", out).returncode == 0
    before = Manifest.load(out).requested
    _killed(_run("index", "merge", *shards, "--out", out, "--index-type", "flat", kill_after=step))
    assert _complete(out) == _fingerprint(old)
    swapped = Manifest.load(out).requested.index_type == "flat"
    assert swapped == (step in ("exchange", "swap")) and (swapped or Manifest.load(out).requested == before)
    finished = _run("index", "merge", *shards, "--out", out, "--index-type", "flat")
    assert finished.returncode == 0, finished.stderr
    assert _complete(out) == _fingerprint(old) and Manifest.load(out).requested.index_type == "flat"
    assert not staging_directory(out).exists()
