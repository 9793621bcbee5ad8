"""Image files made for a test (the synthetic images themselves: ``bench.lib.images``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from PIL import Image


def copy_with_truncated_jpeg(folder: Path, target: Path) -> Path:
    """A copy of the labelled ``folder`` at ``target`` plus ``class_01/broken.jpg``, a JPEG cut short like
    Cars196's train_08144.jpg; returns the broken file."""
    shutil.copytree(folder, target)
    broken = target / "class_01" / "broken.jpg"
    Image.open(target / "class_01" / "img_0.png").convert("RGB").save(broken, quality=90)
    broken.write_bytes(broken.read_bytes()[:-400])
    return broken
