"""``dmlsearch duplicates`` on a real index of generated photos with near-duplicate copies."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from PIL import Image, ImageOps
from typer.testing import CliRunner

from cli.main import app
from engine.embedder import Embedder
from engine.indexing import build_index

runner = CliRunner()
NAMES = ["cat", "coffee", "astronaut", "rocket"]  # the demo gallery's first photos, in its order


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory, exported_model: Path, demo_gallery: Path) -> Path:
    """Four distinct demo photos; the cat also re-encoded and mirrored, the coffee also resized."""
    gallery = tmp_path_factory.mktemp("dup_gallery")
    photos = {name: Image.open(demo_gallery / name / f"{i:02d}_original.jpg") for i, name in enumerate(NAMES)}
    for name, photo in photos.items():
        photo.save(gallery / f"{name}.png")
    photos["cat"].save(gallery / "cat_copy.jpg", quality=70)
    ImageOps.mirror(photos["cat"]).save(gallery / "cat_mirror.png")
    coffee = photos["coffee"]
    coffee.resize((coffee.width // 2, coffee.height // 2)).save(gallery / "coffee_small.png")
    out = tmp_path_factory.mktemp("dup_index") / "index"
    build_index(gallery, Embedder(exported_model, threads=1), out, progress=False)
    return out


def test_groups_are_printed_as_text_json_and_csv(index_dir: Path) -> None:
    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--json"])
    assert result.exit_code == 0, result.output
    groups = [{item["path"] for item in group} for group in json.loads(result.output)["groups"]]
    assert groups == [
        {"cat.png", "cat_copy.jpg", "cat_mirror.png"},
        {"coffee.png", "coffee_small.png"},
    ]

    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert [row["group"] for row in rows] == ["1", "1", "1", "2", "2"]
    assert all(float(row["score"]) >= 0.9 for row in rows)

    result = runner.invoke(app, ["duplicates", "--index", str(index_dir)])
    assert result.exit_code == 0, result.output
    assert "group 1: 3 images" in result.output and "2 groups of near-duplicates" in result.output

    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--threshold", "0.9999", "--json"])
    assert json.loads(result.output)["groups"] == []


def test_bad_input_is_a_clear_error(index_dir: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["duplicates", "--index", str(tmp_path)])
    assert result.exit_code == 2 and "not an index directory" in result.output
    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--json", "--csv"])
    assert result.exit_code == 2 and "one of --json and --csv" in result.output
    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--threshold", "2"])
    assert result.exit_code == 2
