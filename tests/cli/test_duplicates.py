"""``dmlsearch duplicates`` on a real index of demo photos with near-duplicate copies, and on an index built
before perceptual signatures were stored."""

from __future__ import annotations

import csv
import io
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from PIL import Image, ImageEnhance, ImageOps
from typer.testing import CliRunner

from cli.main import app
from engine.build.indexing import build_index
from engine.duplicates.groups import DEFAULT_MAX_DISTANCE, DEFAULT_THRESHOLD, EMBEDDING_ONLY_THRESHOLD
from engine.model.embedder import Embedder
from index.items import ItemStore

runner = CliRunner()
NAMES = ["cat", "coffee", "astronaut", "rocket"]  # the demo gallery's first photos, in its order


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory, exported_model: Path, demo_gallery: Path) -> Path:
    """Four distinct demo photos; the cat also re-encoded and mirrored, the coffee also resized, the
    astronaut also darker (the demo photos' own crop variant is tighter than a signature covers)."""
    gallery = tmp_path_factory.mktemp("dup_gallery")
    photos = {name: Image.open(demo_gallery / name / f"{i:02d}_original.jpg") for i, name in enumerate(NAMES)}
    for name, photo in photos.items():
        photo.save(gallery / f"{name}.png")
    photos["cat"].save(gallery / "cat_copy.jpg", quality=70)
    ImageOps.mirror(photos["cat"]).save(gallery / "cat_mirror.png")
    coffee = photos["coffee"]
    coffee.resize((coffee.width // 2, coffee.height // 2)).save(gallery / "coffee_small.png")
    ImageEnhance.Brightness(photos["astronaut"]).enhance(0.85).save(gallery / "astronaut_dark.jpg")
    out = tmp_path_factory.mktemp("dup_index") / "index"
    build_index(gallery, Embedder(exported_model, threads=1), out, progress=False)
    return out


def test_groups_are_printed_as_text_json_and_csv(index_dir: Path) -> None:
    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert (payload["threshold"], payload["max_distance"], payload["unsigned"]) == (
        DEFAULT_THRESHOLD,
        DEFAULT_MAX_DISTANCE,
        0,
    )
    groups = [{item["path"] for item in group} for group in payload["groups"]]
    assert groups == [
        {"cat.png", "cat_copy.jpg", "cat_mirror.png"},
        {"astronaut.png", "astronaut_dark.jpg"},
        {"coffee.png", "coffee_small.png"},
    ]

    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert [row["group"] for row in rows] == ["1", "1", "1", "2", "2", "3", "3"]
    assert all(float(row["score"]) >= DEFAULT_THRESHOLD for row in rows)

    result = runner.invoke(app, ["duplicates", "--index", str(index_dir)])
    assert result.exit_code == 0, result.output
    assert "group 1: 3 images" in result.output
    assert (
        f"3 groups of near-duplicates at cosine >= {DEFAULT_THRESHOLD} with perceptual signatures"
        in result.output
    )

    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--max-distance", "0", "--json"])
    stricter = [{item["path"] for item in group} for group in json.loads(result.output)["groups"]]
    assert all(any(group <= wider for wider in groups) for group in stricter)  # never joins more

    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--threshold", "0.9999", "--json"])
    assert json.loads(result.output)["groups"] == []


def test_bad_input_is_a_clear_error(index_dir: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["duplicates", "--index", str(tmp_path)])
    assert result.exit_code == 2 and "not an index directory" in result.output
    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--json", "--csv"])
    assert result.exit_code == 2 and "one of --json and --csv" in result.output
    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--threshold", "2"])
    assert result.exit_code == 2
    result = runner.invoke(app, ["duplicates", "--index", str(index_dir), "--max-distance", "17"])
    assert result.exit_code == 2


def test_an_index_without_signatures_is_judged_by_cosine_with_a_note(index_dir: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(index_dir, old)
    with sqlite3.connect(old / ItemStore.FILE_NAME) as connection:
        connection.execute("DROP TABLE signatures")  # as an index built by an earlier version
    result = runner.invoke(app, ["duplicates", "--index", str(old), "--json"])
    assert result.exit_code == 0, result.output
    assert "8 of 8 items have no perceptual signature" in result.stderr
    payload = json.loads(result.stdout)
    assert (payload["threshold"], payload["unsigned"]) == (EMBEDDING_ONLY_THRESHOLD, 8)
    assert {"cat.png", "cat_copy.jpg"} <= {item["path"] for item in payload["groups"][0]}
    result = runner.invoke(app, ["duplicates", "--index", str(old)])
    summary = result.stdout.splitlines()[-1]  # no claim about signatures the items do not have
    assert summary.endswith(
        f"at cosine >= {EMBEDDING_ONLY_THRESHOLD} (no item has a perceptual signature: by cosine alone)"
    )
