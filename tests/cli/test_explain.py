"""``dmlsearch explain QUERY ITEM_ID --index DIR --out why.png``, as a real process."""

from __future__ import annotations

import subprocess
from pathlib import Path

from PIL import Image

from index.gallery import GalleryIndex


def _dmlsearch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["dmlsearch", *args], capture_output=True, text=True, timeout=300)


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
    assert run.stdout.startswith("cosine ") and f"wrote {out}" in run.stdout
    image = Image.open(out)
    assert image.format == "PNG" and image.width == 2 * 224 and image.height > 224


def test_explain_names_what_is_wrong(demo_index: Path, demo_gallery: Path, tmp_path: Path) -> None:
    query = next(demo_gallery.rglob("*.jpg"))
    unknown = _dmlsearch(
        "explain", str(query), "987654", "--index", str(demo_index), "--out", str(tmp_path / "x.png")
    )
    assert unknown.returncode != 0 and "no item with id 987654" in unknown.stderr
    missing = _dmlsearch("explain", str(tmp_path / "nope.jpg"), "1", "--index", str(demo_index))
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    assert not (tmp_path / "x.png").exists()
