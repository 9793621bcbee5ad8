"""Progress written to a pipe or a file (issue 44): whole lines now and then, never a bar redrawn with
carriage returns nor blank lines (foundation.progress)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bench.lib.images import make_image

REPO = Path(__file__).resolve().parents[2]


def piped(*args: object) -> str:
    """A command's stdout and stderr as a pipe gets them (no terminal), carriage returns kept."""
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", *map(str, args)], cwd=REPO, capture_output=True, timeout=300
    )
    output = (done.stdout + done.stderr).decode()  # bytes: text mode would turn "\r" into "\n"
    assert done.returncode == 0, output
    return output


def assert_plain_lines(output: str, desc: str) -> None:
    assert "\r" not in output
    assert all(line.strip() for line in output.splitlines()), output  # no blank progress lines
    percents = [int(p) for p in re.findall(rf"^{desc}: (\d+)% \(\d+/\d+\)", output, flags=re.MULTILINE)]
    assert percents[0] == 0 and percents[-1] == 100 and len(percents) >= 5, output  # every 10%


def test_build_index_index_add_and_rebuild_print_plain_progress_lines_into_a_pipe(
    small_model: Path, tmp_path: Path
) -> None:
    gallery = tmp_path / "gallery"
    for label in range(2):
        (gallery / f"class_{label}").mkdir(parents=True)
        for i in range(20):
            make_image(100 * label + i).save(gallery / f"class_{label}" / f"img_{i}.png")
    index = tmp_path / "index"
    output = piped("build-index", gallery, "--out", index, "--model", small_model)
    assert_plain_lines(output, "embedding")
    assert_plain_lines(output, "hashing")
    (gallery / "extra").mkdir()
    for i in range(10):
        make_image(900 + i).save(gallery / "extra" / f"x_{i}.png")
    assert_plain_lines(piped("index", "add", index, gallery / "extra"), "embedding")
    rebuilt = piped("index", "rebuild", index, "--model", small_model, "--out", tmp_path / "rebuilt")
    assert_plain_lines(rebuilt, "embedding")


def test_the_embedding_count_says_what_was_embedded_and_what_was_skipped(
    small_model: Path, tmp_path: Path
) -> None:
    """A truncated JPEG is looked at but not embedded: the progress line does not count it as embedded."""
    gallery = tmp_path / "gallery" / "cars"
    gallery.mkdir(parents=True)
    for i in range(5):
        make_image(i).save(gallery / f"img_{i}.jpg")
    whole = (gallery / "img_0.jpg").read_bytes()
    (gallery / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    output = piped("build-index", tmp_path / "gallery", "--out", tmp_path / "index", "--model", small_model)
    last = re.findall(r"^embedding: .*$", output, flags=re.MULTILINE)[-1]
    assert "(6/6)" in last and "5 embedded, 1 skipped" in last, output
