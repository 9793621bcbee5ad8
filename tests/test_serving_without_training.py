"""Serving runs without the `train` extra: the serving image has no torch, so neither may the code it runs.

Each module of the `train` extra (read from pyproject.toml) is replaced by one that fails to import; then
every module of app, engine, index, foundation and cli is imported, an index is built and searched through a
real `dmlsearch serve`.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from bench.lib.images import export_small_model, image_bytes, make_image, write_labelled_folder
from tests.support.servers import uvicorn_server

REPO = Path(__file__).resolve().parents[1]
SERVING_PACKAGES = ("app", "engine", "index", "foundation", "cli")


def train_only_modules() -> list[str]:
    """The top-level modules the `train` extra's distributions install (torch, sklearn, ...)."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    distributions = {re.split(r"[\s<>=!~;\[]", requirement)[0].lower() for requirement in extra}
    modules = {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if any(owner.lower().replace("_", "-") in distributions for owner in owners)
    }
    assert "torch" in modules and "sklearn" in modules  # the mapping found the distributions
    return sorted(modules)


@pytest.fixture(scope="module")
def without_training(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment where importing any train-only module fails, as in the serving image."""
    blocked = tmp_path_factory.mktemp("blocked")
    for module in train_only_modules():
        (blocked / module).mkdir()
        (blocked / module / "__init__.py").write_text(
            f"raise ImportError('{module} belongs to the train extra, absent from the serving image')\n"
        )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)])}


def test_every_serving_module_imports_without_the_train_extra(without_training: dict[str, str]) -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        f"for package in {SERVING_PACKAGES!r}:\n"
        "    root = importlib.import_module(package)\n"
        "    for module in pkgutil.walk_packages(root.__path__, package + '.'):\n"
        "        importlib.import_module(module.name)\n"
        "import torch\n"  # the blocker itself works: this must fail
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=without_training, cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "ImportError: torch belongs to the train extra" in result.stderr.splitlines()[-1], result.stderr


@pytest.mark.server
def test_build_index_serve_and_search_without_the_train_extra(
    without_training: dict[str, str], tmp_path: Path
) -> None:
    model = export_small_model(tmp_path / "model" / "model.onnx", seed=3)  # here, with torch
    gallery = write_labelled_folder(tmp_path / "gallery", classes=3, per_class=2)
    index = tmp_path / "index"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "build-index",
            str(gallery),
            "--model",
            str(model),
            "--out",
            str(index),
        ],
        env=without_training,
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    with uvicorn_server(["--index", str(index)], without_training) as url:
        answer = httpx.post(
            f"{url}/v1/search", files={"image": ("q.png", image_bytes(make_image(7)))}, timeout=60
        )
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["results"]) > 0


@pytest.mark.parametrize("command", [["losses"], ["export", "--out", "model.onnx"], ["demo", "--no-serve"]])
def test_training_commands_name_the_missing_extra(
    without_training: dict[str, str], command: list[str], tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", *command],
        env=without_training,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert "needs the train extra (torch): pip install 'dmlsearch[train]'" in result.stderr
    assert "Traceback" not in result.stderr
