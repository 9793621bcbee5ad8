"""``dmlsearch query IMAGE --box``: the region is the query; a bad box is a one-line error, exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from bench.lib.images import make_image
from cli.main import app

runner = CliRunner()
CAT = "cat/00_crop.jpg"


def query(image: Path, index: Path, model: Path, *extra: str) -> object:
    return runner.invoke(
        app, ["query", str(image), "--index", str(index), "--model", str(model), "-k", "78", *extra]
    )


def test_query_box_searches_by_the_region(
    exported_model: Path, demo_gallery: Path, demo_index: Path, tmp_path: Path
) -> None:
    photo = Image.open(demo_gallery / CAT).convert("RGB")
    scene = make_image(3, (1000, 700))
    scene.paste(photo, (520, 300))
    scene.save(tmp_path / "scene.png")
    box = f"520,300,{520 + photo.width},{300 + photo.height}"
    boxed = query(tmp_path / "scene.png", demo_index, exported_model, "--box", box, "--json")
    assert boxed.exit_code == 0, boxed.output
    top = json.loads(boxed.output)["results"][0]
    assert top["path"] == CAT
    assert top["score"] == pytest.approx(1.0, abs=1e-3)
    whole = query(tmp_path / "scene.png", demo_index, exported_model, "--json")
    scores = {result["path"]: result["score"] for result in json.loads(whole.output)["results"]}
    assert scores[CAT] < 0.9
    table = query(tmp_path / "scene.png", demo_index, exported_model, "--box", box)
    assert table.exit_code == 0
    assert table.output.splitlines()[1].split()[-1] == CAT


@pytest.mark.parametrize(
    ("box", "says"),
    [
        ("1,2,3", "--box: box '1,2,3' is not four numbers x0,y0,x1,y1"),
        ("300,10,200,100", "--box: box '300,10,200,100' is inverted or empty"),
        ("900,10,1200,300", "box 900,10,1200,300 reaches outside the 1000x700 image"),
        ("10,10,20,300", "box 10,10,20,300 is 10x290 pixels of the 1000x700 image, less than the minimum"),
    ],
)
def test_a_bad_box_is_a_clear_error(
    exported_model: Path, demo_index: Path, tmp_path: Path, box: str, says: str
) -> None:
    make_image(3, (1000, 700)).save(tmp_path / "scene.png")
    result = query(tmp_path / "scene.png", demo_index, exported_model, "--box", box)
    assert result.exit_code == 2
    assert says in " ".join(result.output.split())
    assert "Traceback" not in result.output
