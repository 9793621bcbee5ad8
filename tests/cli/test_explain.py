"""``dmlsearch explain QUERY ITEM_ID --index DIR --out why.png``, as a real process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

from index.gallery import GalleryIndex


def _dmlsearch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=300
    )


def test_explain_writes_the_overlay_png(demo_index: Path, demo_gallery: Path, tmp_path: Path) -> None:
    index = GalleryIndex.open(demo_index)
    first, second = index.items.page(0, 2)
    index.close()
    out = tmp_path / "why.png"
    run = _dmlsearch(
        "explain",
        str(demo_gallery / first.path),
        str(second.id),
        "--index",
        str(demo_index),
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("Similarity 0.") and "(the cosine of the two embeddings" in lines[0]
    assert re.fullmatch(r"The outlined regions, one in each image, carry -?[0-9.]+% of the match\.", lines[2])
    assert lines[-1] == f"wrote {out}" and "positions" not in run.stdout
    image = Image.open(out)  # two 448-px images side by side, a person can read them (224-px each before)
    assert image.format == "PNG" and image.width >= 2 * 448 and image.height > 448 + 3 * 18


def test_explain_names_what_is_wrong(demo_index: Path, demo_gallery: Path, tmp_path: Path) -> None:
    query = next(demo_gallery.rglob("*.jpg"))
    unknown = _dmlsearch(
        "explain", str(query), "987654", "--index", str(demo_index), "--out", str(tmp_path / "x.png")
    )
    assert unknown.returncode != 0 and "no item with id 987654" in unknown.stderr
    missing = _dmlsearch("explain", str(tmp_path / "nope.jpg"), "1", "--index", str(demo_index))
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    assert not (tmp_path / "x.png").exists()


def test_explain_a_box_of_the_query(demo_index: Path, demo_gallery: Path, tmp_path: Path) -> None:
    index = GalleryIndex.open(demo_index)
    first, second = index.items.page(0, 2)
    index.close()
    query = str(demo_gallery / first.path)
    args = ("explain", query, str(second.id), "--index", str(demo_index), "--out")
    whole = _dmlsearch(*args, str(tmp_path / "whole.png"))
    boxed = _dmlsearch(*args, str(tmp_path / "boxed.png"), "--box", "0.1,0.2,0.7,0.9")
    assert whole.returncode == 0 and boxed.returncode == 0, boxed.stderr
    assert whole.stdout.splitlines()[0] != boxed.stdout.splitlines()[0]  # another cosine: the region's
    bad = _dmlsearch(*args, str(tmp_path / "bad.png"), "--box", "0.7,0.2,0.1,0.9")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --box:"), bad.stderr
    assert not (tmp_path / "bad.png").exists()


def test_a_folder_given_as_the_query_is_named_as_a_folder(tmp_path: Path) -> None:
    for command in ("query", "explain"):
        args = [str(tmp_path), "1"] if command == "explain" else [str(tmp_path)]
        run = _dmlsearch(command, *args, "--index", str(tmp_path))  # said before the index is opened
        assert run.returncode == 2
        expected = f"error: {tmp_path} is a folder, not a regular file: a query is an image file"
        assert run.stderr.startswith(expected), run.stderr
