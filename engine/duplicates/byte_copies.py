"""Byte copies: files of the gallery folder with the bytes of an indexed image.

An index holds one item per content (``engine.build.sync``: the first path; build-index lists the others),
so the duplicate review finds the other files here, from the folder: the exact tier's commonest case, the
same photo saved twice. Only files that are not items and have the size of an item's file are hashed (a
copy has its original's size), so looking at a folder costs its listing and a ``stat`` per file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.duplicates.tiers import ByteCopy
from engine.gallery.files import list_images, resolves_inside
from engine.gallery.hashing import file_hash
from index.protocol import Item


def find_byte_copies(root: Path, items: Iterable[Item]) -> dict[int, list[ByteCopy]]:
    """Item id -> the files under ``root`` (the trash excluded) that are not items and have its bytes."""
    indexed = {item.path: item for item in items}
    by_size: dict[int, list[Item]] = {}
    for item in indexed.values():
        try:
            by_size.setdefault((root / item.path).stat().st_size, []).append(item)
        except OSError:  # gone since it was indexed: nothing can be a copy of it now
            continue
    copies: dict[int, list[ByteCopy]] = {}
    for path in list_images(root):
        relative = path.relative_to(root).as_posix()
        if relative in indexed or not resolves_inside(path, root):
            continue
        try:
            same_size = by_size.get(path.stat().st_size)
            content_hash = file_hash(path) if same_size else None
        except OSError:
            continue
        for item in same_size or ():
            if item.content_hash == content_hash:
                copies.setdefault(item.id, []).append(ByteCopy(relative, item.id, content_hash))
                break
    return copies
