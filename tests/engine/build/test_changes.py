"""Debouncing and batching of real file events (watchdog's Observer on a temporary folder)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from watchdog.observers import Observer

from bench.lib.images import image_bytes, make_image
from engine.build.changes import ChangeBatcher
from tests.support.waiting import wait_until

SETTLE = 0.3


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Path, ChangeBatcher, list[list[Path]]]]:
    """A folder under a real observer; a thread collects the batches the batcher hands out."""
    folder = tmp_path / "folder"
    folder.mkdir()
    batcher = ChangeBatcher(settle=SETTLE, max_batch=512)
    observer = Observer()
    observer.schedule(batcher, str(folder), recursive=True)
    observer.start()
    batches: list[list[Path]] = []
    stop = threading.Event()

    def collect() -> None:
        while batch := batcher.next_batch(stop):
            batches.append(batch)

    collector = threading.Thread(target=collect)
    collector.start()
    yield folder, batcher, batches
    stop.set()
    collector.join(timeout=10)
    observer.stop()
    observer.join()


def test_a_burst_of_1000_copies_becomes_a_few_batches(
    watched: tuple[Path, ChangeBatcher, list[list[Path]]], tmp_path: Path
) -> None:
    folder, _, batches = watched
    source = tmp_path / "source.png"
    source.write_bytes(image_bytes(make_image(1, (32, 32))))
    (folder / "sub").mkdir()
    wait_until(lambda: batches, 10, "the new folder's batch")
    batches.clear()
    copies = {folder / "sub" / f"copy_{i:04d}.png" for i in range(1000)}
    for target in sorted(copies):
        shutil.copy(source, target)

    wait_until(lambda: copies <= {p for batch in batches for p in batch}, 60, "all 1,000 copies in batches")
    # 1,000 paths, at most 512 a batch: 2 or 3 batches, not 1,000.
    assert 2 <= len(batches) <= 4, [len(batch) for batch in batches]
    assert all(len(batch) <= 512 for batch in batches)


def test_a_file_being_written_is_not_handed_out_until_it_stops_changing(
    watched: tuple[Path, ChangeBatcher, list[list[Path]]],
) -> None:
    folder, _, batches = watched
    data = image_bytes(make_image(2, (200, 200)))
    target = folder / "slow.png"
    chunks = [data[i : i + len(data) // 8 + 1] for i in range(0, len(data), len(data) // 8 + 1)]
    with target.open("wb") as handle:
        for chunk in chunks:  # a slow copy: a write every third of the settle interval
            handle.write(chunk)
            handle.flush()
            assert not any(target in batch for batch in batches), "handed out while still being written"
            threading.Event().wait(SETTLE / 3)
    wait_until(lambda: any(target in batch for batch in batches), 10, "the finished file")
    assert target.stat().st_size == len(data)


def test_deletions_and_moves_report_both_paths(
    watched: tuple[Path, ChangeBatcher, list[list[Path]]],
) -> None:
    folder, _, batches = watched
    (folder / "a.png").write_bytes(b"x")
    (folder / "b.png").write_bytes(b"y")
    wait_until(lambda: len({p for batch in batches for p in batch}) >= 2, 10, "the two new files")
    batches.clear()
    (folder / "a.png").rename(folder / "renamed.png")
    (folder / "b.png").unlink()
    wanted = {folder / "a.png", folder / "renamed.png", folder / "b.png"}
    wait_until(lambda: wanted <= {p for batch in batches for p in batch}, 10, "the move and the deletion")


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="settle"):
        ChangeBatcher(settle=0)
