"""Byte copies are found from the gallery folder: files with an item's bytes that are not items."""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.duplicates.byte_copies import find_byte_copies
from engine.duplicates.tiers import ByteCopy
from foundation.defaults import TRASH_FOLDER
from index.protocol import Item


def _item(item_id: int, root: Path, path: str) -> Item:
    digest = hashlib.sha256((root / path).read_bytes()).hexdigest()
    return Item(item_id, path, None, digest, "2026-01-01T00:00:00+00:00")


def test_only_files_with_an_items_bytes_outside_the_trash_are_its_copies(tmp_path: Path) -> None:
    (tmp_path / "cats").mkdir()
    (tmp_path / "a.png").write_bytes(b"A" * 100)
    (tmp_path / "cats" / "a again.png").write_bytes(b"A" * 100)  # a copy, in another folder
    (tmp_path / "same size.png").write_bytes(b"B" * 100)  # the size of a.png, other bytes
    (tmp_path / "b.png").write_bytes(b"B" * 50)  # an item of its own
    (tmp_path / "gone.png").write_bytes(b"C" * 10)  # a copy of an item whose file is gone
    trash = tmp_path / TRASH_FOLDER / "plan"
    trash.mkdir(parents=True)
    (trash / "a.png").write_bytes(b"A" * 100)  # set aside by a plan: not part of the gallery
    items = [_item(1, tmp_path, "a.png"), _item(2, tmp_path, "b.png"), _item(3, tmp_path, "gone.png")]
    (tmp_path / "gone.png").rename(tmp_path / "moved.png")

    copies = find_byte_copies(tmp_path, items)

    assert copies == {1: [ByteCopy("cats/a again.png", 1, items[0].content_hash)]}
