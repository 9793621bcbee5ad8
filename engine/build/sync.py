"""Bring an index's items up to date with gallery files: the plan (what to embed, move, remove) from their
content hashes, then the sync that carries it out."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.build.embedding import EmbeddingRunner, LocalRunner
from engine.build.report import BuildReport, MovedFile
from engine.decode.capture_time import photo_time
from engine.gallery.hashing import GalleryFile, label_of
from engine.gallery.keeper import GroupVectors, choose_keeper, file_facts
from engine.model.embedder import Embedder
from foundation.defaults import DECODE_WORKERS
from index.gallery import GalleryIndex
from index.protocol import Item, Move
from index.sharding import Shard


@dataclass
class SyncPlan:
    embed: list[GalleryFile] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)
    moved_files: list[MovedFile] = field(default_factory=list)  # the moves, as a report names them
    unchanged: int = 0
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    undated: dict[int, Path] = field(default_factory=dict)  # kept items without a capture time: their files


def plan_sync(
    files: Sequence[GalleryFile], stored: Iterable[Item], *, gone: Callable[[str], bool]
) -> SyncPlan:
    """What to embed, move and remove so the stored items match ``files``.

    An item is kept when its path still holds the same content; a changed file is removed and embedded
    again. An item whose path is not among ``files`` and whose file is ``gone`` has moved when one of
    ``files`` holds its content (it keeps its id and vector under the new path), and is removed otherwise.
    Content already indexed is reported as a duplicate instead of being embedded twice; among new files of
    one content, a file in a label folder is indexed before one without a label, then the first in path
    order (:func:`keep_sources` then gives the item to the file the keeper rule picks). Kept items indexed
    before capture times were kept are listed to be dated.
    """
    plan = SyncPlan()
    current = {f.relative: f.content_hash for f in files}
    paths = {f.relative: f.path for f in files}
    first_path: dict[str, str] = {}  # content hash -> the path that holds it in the index
    kept: set[str] = set()
    moved_away: dict[str, list[Item]] = {}  # content hash -> items whose file is gone
    for item in stored:
        content = current.get(item.path)
        if content == item.content_hash:
            kept.add(item.path)
            first_path.setdefault(item.content_hash, item.path)
            if item.taken is None:
                plan.undated[item.id] = paths[item.path]
        elif content is not None:
            plan.remove.append(item.id)
        elif gone(item.path):
            moved_away.setdefault(item.content_hash, []).append(item)
        else:  # not part of this sync and still on disk
            first_path.setdefault(item.content_hash, item.path)
    for gallery_file in sorted(files, key=lambda f: (f.label is None, f.relative)):
        content_hash = gallery_file.content_hash
        if gallery_file.relative in kept:
            plan.unchanged += 1
        elif content_hash in first_path:
            plan.duplicates.append((gallery_file.relative, first_path[content_hash]))
        elif moved_away.get(content_hash):
            item = moved_away[content_hash].pop(0)
            plan.moves.append(Move(item.id, gallery_file.relative, gallery_file.label))
            plan.moved_files.append(
                MovedFile(item.path, gallery_file.relative, item.label, gallery_file.label)
            )
            first_path[content_hash] = gallery_file.relative
        else:
            first_path[content_hash] = gallery_file.relative
            plan.embed.append(gallery_file)
    plan.remove.extend(item.id for items in moved_away.values() for item in items)
    plan.embed.sort(key=lambda f: f.relative)  # ids follow path order, whatever the preference above
    return plan


def sync_files(
    index: GalleryIndex,
    root: Path,
    files: Sequence[Path],
    embedder: Embedder,
    report: BuildReport,
    *,
    gone: Callable[[str], bool],
    shard: Shard | None = None,
    batch_size: int,
    progress: bool,
    decode_workers: int = DECODE_WORKERS,
    runner: EmbeddingRunner | None = None,
) -> SyncPlan:
    """Bring the items of ``files`` (and of the stored items whose file is ``gone``) up to date in ``index``.

    The index is changed but not rebuilt or saved: the caller does both. ``runner``: where files are hashed
    and embedded (default: this process, with ``decode_workers``).
    """
    runner = runner or LocalRunner(decode_workers)
    hashed = runner.hash_files(root, files, report, progress)
    stored = (item for item in index.items.scan() if shard is None or shard.owns(item.path))
    plan = plan_sync(hashed, stored, gone=gone)
    report.unchanged, report.duplicates = plan.unchanged, plan.duplicates
    if plan.remove:
        report.removed = index.remove(plan.remove)
    if plan.moves:
        report.moved = index.move(plan.moves)
        report.moves = plan.moved_files
    if plan.undated:  # an index from before capture times were kept: read them from the headers, once
        report.dated = index.set_taken({item_id: photo_time(path) for item_id, path in plan.undated.items()})
    runner.embed_files(index, embedder, plan.embed, report, batch_size=batch_size, progress=progress)
    if plan.duplicates:  # after the embedding: the keeper rule's folder key reads the items' vectors
        report.duplicates = keep_sources(index, root, plan.duplicates)
    return plan


def keep_sources(
    index: GalleryIndex, root: Path, duplicates: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Give each item whose content several files hold the path the keeper rule picks among them
    (``engine.gallery.keeper``: the photo in its label folder, not ``edited/IMG_4 copy.jpg`` by path
    order). ``duplicates``: (path, the path whose item holds its content); returns them as (path, the
    path that holds it now)."""
    copies: dict[str, list[str]] = {}
    for path, held_by in duplicates:
        copies.setdefault(held_by, []).append(path)
    vectors = GroupVectors(index)
    moves: list[Move] = []
    kept: list[tuple[str, str]] = []
    for held_by, paths in copies.items():
        item = index.items.get_by_path(held_by)
        if item is None:  # not this index's item (another shard's)
            kept.extend((path, held_by) for path in paths)
            continue
        files = [held_by, *paths]
        facts = [file_facts(root / path, label_of(path), item.taken or item.added) for path in files]
        home = vectors.home_folder([item.id], [fact.label for fact in facts])
        chosen = files[choose_keeper(facts, home).keeper]
        if chosen != held_by:
            moves.append(Move(item.id, chosen, label_of(chosen)))
        kept.extend((path, chosen) for path in files if path != chosen)
    if moves:
        index.move(moves)
    return kept
