"""``dmlsearch query`` and ``explain`` decode their query image under the server's limits (issue 43, class 2):
before, they decoded it in their own process without any (167 s of CPU for one hostile file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.hostile_images import jpeg_repeated_scan
from index.gallery import GalleryIndex


def _dmlsearch(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def costly(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 280 KB progressive JPEG repeating one scan 1,000 times: some 20 s of CPU to decode here."""
    path = tmp_path_factory.mktemp("hostile") / "scans.jpg"
    path.write_bytes(jpeg_repeated_scan(1000))
    return path


@pytest.mark.parametrize("command", ["query", "explain"])
def test_a_costly_query_image_is_refused_by_the_servers_cpu_limit(
    command: str, costly: Path, demo_index: Path
) -> None:
    """The same setting as the server's (DMLSEARCH_DECODE_CPU_SECONDS, set low to keep the test short)."""
    index = GalleryIndex.open(demo_index)
    (item,) = index.items.page(0, 1)
    index.close()
    item_argument = [str(item.id)] if command == "explain" else []
    run = _dmlsearch(
        command,
        str(costly),
        *item_argument,
        "--index",
        str(demo_index),
        DMLSEARCH_DECODE_CPU_SECONDS="1",
    )
    assert run.returncode == 2, run.stderr
    # explain decodes the query with the item's file, and names the query as the first of the two
    named = "image 0: " if command == "explain" else ""
    expected = f"error: {costly}: {named}decoding took more than 1 s of CPU, the limit for one image"
    assert run.stderr.startswith(expected), run.stderr
