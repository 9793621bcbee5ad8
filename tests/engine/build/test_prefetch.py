"""The decode pipeline: order kept, bad files reported in place, bounded look-ahead, serial parity."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.lib.images import image_bytes, make_image
from cli.main import app
from engine.build.indexing import build_index
from engine.build.prefetch import MAX_NICENESS, WORKER_NICENESS, prefetch
from engine.decode.images import ImageDecodeError, load_image_file
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_results_come_in_order_with_errors_in_place(workers: int) -> None:
    def load(n: int) -> int:
        time.sleep(0.002 * (n % 3))  # later items often finish first
        if n % 5 == 4:
            raise ImageDecodeError("corrupt_image", f"item {n}")
        return n * n

    results = list(prefetch(range(20), load, workers=workers, depth=4))
    assert [item for item, _ in results] == list(range(20))
    for item, result in results:
        if item % 5 == 4:
            assert isinstance(result, ImageDecodeError) and result.message == f"item {item}"
        else:
            assert result == item * item


def test_other_errors_propagate() -> None:
    def load(n: int) -> int:
        raise RuntimeError("a bug, not a bad file")

    with pytest.raises(RuntimeError, match="a bug"):
        list(prefetch(range(3), load, workers=2, depth=2))


def test_look_ahead_is_bounded_by_depth() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def load(n: int) -> int:
        with lock:
            started.append(n)
        return n

    consumed = 0
    for item, _ in prefetch(range(50), load, workers=4, depth=6):
        time.sleep(0.002)  # a slow consumer: the model
        with lock:
            assert len(started) <= item + 6  # never more than depth items beyond the one consumed
        consumed += 1
    assert consumed == 50


def _own_niceness(_: object = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux gives each thread its own niceness")
def test_workers_yield_the_cores_to_the_calling_thread() -> None:
    """Decoding threads run below the model's priority, so they do not preempt its intra-op threads."""
    caller = _own_niceness()
    niceness = [result for _, result in prefetch(range(4), _own_niceness, workers=2, depth=4)]
    assert niceness == [min(MAX_NICENESS, caller + WORKER_NICENESS)] * 4
    assert _own_niceness() == caller
    # A process the user already niced past 19 - WORKER_NICENESS: its workers stop at 19 (rising would fail).
    script = (
        "import os, threading; os.nice(15); from engine.build.prefetch import prefetch; "
        "print([r for _, r in prefetch(range(2), lambda _: os.getpriority(os.PRIO_PROCESS, "
        "threading.get_native_id()), workers=1, depth=2)])"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"[{MAX_NICENESS}, {MAX_NICENESS}]"


def test_parallel_build_embeds_what_serial_decoding_embeds(tmp_path: Path, exported_model: Path) -> None:
    gallery = tmp_path / "gallery"
    (gallery / "a").mkdir(parents=True)
    for i in range(7):  # large JPEGs take the draft-decoding path, PNGs the plain one
        fmt, size = ("JPEG", (1200, 900)) if i % 2 else ("PNG", (90, 70))
        (gallery / "a" / f"{i}.{fmt.lower()}").write_bytes(image_bytes(make_image(i, size=size), fmt))
    embedder = Embedder(exported_model, threads=1)
    out = tmp_path / "index"
    build_index(gallery, embedder, out, batch_size=3, progress=False)
    index = GalleryIndex.open(out)
    try:
        items = sorted(index.items.scan(), key=lambda item: item.path)
        stored = index.items.vectors(np.array([item.id for item in items]))
    finally:
        index.close()
    draft = embedder.card.preprocessing.resize_size
    serial = embedder.embed([load_image_file(gallery / item.path, draft_size=draft) for item in items])
    np.testing.assert_allclose(stored, serial, atol=1e-5)

    # The CLI without the pool (decoding on the calling thread) stores the very same vectors.
    out_serial = tmp_path / "serial"
    args = ["build-index", str(gallery), "--out", str(out_serial), "--model", str(exported_model)]
    result = CliRunner().invoke(app, [*args, "--decode-workers", "0", "--threads", "1", "--no-progress"])
    assert result.exit_code == 0, result.output
    index = GalleryIndex.open(out_serial)
    try:
        by_path = {item.path: item.id for item in index.items.scan()}
        assert sorted(by_path) == [item.path for item in items]
        serial_stored = index.items.vectors(np.array([by_path[item.path] for item in items]))
    finally:
        index.close()
    np.testing.assert_array_equal(serial_stored, stored)
