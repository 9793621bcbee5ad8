"""A gallery file as an index knows it: its path, its label (its folder's name) and its content hash."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from foundation.names import readable_name
from foundation.regular_files import open_regular


@dataclass(frozen=True)
class GalleryFile:
    path: Path
    relative: str
    label: str | None
    content_hash: str


def label_of(relative: str) -> str | None:
    """A gallery file's label: the name of its folder (None for a file at the top of the gallery), in its
    readable form when the name is not UTF-8 (a label is shown and matched, never opened)."""
    return readable_name(Path(relative).parent.name) or None


def file_hash(path: Path) -> str:
    with open_regular(path) as file:  # in chunks: no copy of a whole 12-MP photo in memory
        return hashlib.file_digest(file, "sha256").hexdigest()
