"""What a build, a sync or a rebuild did: the counts and lists a command reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MovedFile:
    """An item whose file was renamed or moved: it keeps its id and vector under the new path and label."""

    old_path: str
    new_path: str
    old_label: str | None
    new_label: str | None


@dataclass
class BuildReport:
    indexed: int = 0  # files embedded and added by this run
    unchanged: int = 0  # files already indexed with the same content
    removed: int = 0  # items whose file is gone or changed
    moved: int = 0  # items whose file was renamed or moved (same content: same id, not re-embedded)
    moves: list[MovedFile] = field(default_factory=list)  # which, with their labels before and after
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (relative path, path it duplicates)
    dated: int = 0  # items indexed before capture times were kept that now have theirs
    rebuilt: bool = False  # whether the search index was (re)built rather than updated in place
    # Items re-embedded under their ids because the index was built with another model, and that model.
    reembedded: int = 0
    previous_model: str | None = None
