"""Fault suite, process half: SIGTERM of ``build-index`` and ``watch`` in real processes.

They stop at a batch boundary with every added batch saved, and a rerun continues from there; also when the
signal reaches the whole process group (``kill -- -PGID``, systemd's control group), decode workers included.
(``train``: tests/training/test_stop_signal.py; ``serve`` and ``demo``: tests/app/test_fault_signals.py.)
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib.images import make_image, write_labelled_folder
from index.gallery import GalleryIndex
from index.staging import staging_directory
from tests.support.waiting import wait_until

BATCH = 4


def _committed(index: Path) -> int:
    try:
        with sqlite3.connect(f"file:{index / 'items.sqlite'}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM items").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.parametrize(("decode_workers", "whole_group"), [(0, False), (1, True)])
def test_sigterm_of_build_index_stops_at_a_batch_and_the_rerun_continues(
    tmp_path: Path, exported_model: Path, decode_workers: int, whole_group: bool
) -> None:
    gallery = write_labelled_folder(tmp_path / "gallery", classes=6, per_class=5)  # 30 images
    out = tmp_path / "index"
    command = [sys.executable, "-m", "cli.main", "build-index", str(gallery), "--model", str(exported_model)]
    command += ["--out", str(out), "--batch-size", str(BATCH), "--no-progress"]
    command += ["--decode-workers", str(decode_workers)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=whole_group
    )
    staging = staging_directory(out)  # a new index is written aside until it is complete
    wait_until(lambda: _committed(staging) >= BATCH or process.poll() is not None, 120, "a committed batch")
    if whole_group:
        os.killpg(process.pid, signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, output  # before: killed outright, no message
    assert "run the same command again to continue" in output
    assert not out.exists()
    kept = _committed(staging)
    assert 0 < kept < 30 and kept % BATCH == 0  # whole batches only, and not the whole gallery

    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert f"{kept} unchanged" in finished.stdout  # the saved batches were kept, not embedded again
    index = GalleryIndex.open(out)
    assert len(index) == len(index.items) == 30
    index.close()


@pytest.mark.server
def test_sigterm_of_watch_exits_0_and_the_next_start_catches_up(tmp_path: Path, exported_model: Path) -> None:
    gallery, index, log = tmp_path / "gallery", tmp_path / "index", tmp_path / "watch.log"
    (gallery / "cats").mkdir(parents=True)
    for i in range(3):
        make_image(i, size=(64, 56)).save(gallery / "cats" / f"{i}.png")
    command = [sys.executable, "-m", "cli.main", "watch", str(gallery), "--index", str(index)]
    command += ["--model", str(exported_model), "--settle", "0.2"]

    def start() -> subprocess.Popen:
        with log.open("a") as output:
            return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)

    process = start()
    try:
        wait_until(lambda: "watching" in log.read_text(), 120, "the watcher to catch up")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0  # before: 143, killed by the signal
        assert "stopped" in log.read_text()
        make_image(9, size=(64, 56)).save(gallery / "cats" / "while_down.png")
        process = start()
        wait_until(lambda: log.read_text().count("watching") == 2, 120, "the second catch-up")
        assert _committed(index) == 4
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0
