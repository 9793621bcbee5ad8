"""Reviewing duplicate groups: a keeper per group, a plan on disk, and applying or undoing it safely.

A plan (JSON) lists each group with its tier, evidence and members; each member is ``keep`` or
``set_aside``. The keeper rule proposes one keeper per group (largest pixel count, then largest file, then
earliest date; the order can be changed); a person may edit the plan. Applying it moves each set-aside
file into ``TRASH_FOLDER/<plan id>/`` inside the gallery (same relative path) and removes its item from
the index; undoing moves the files back and indexes them again. A byte copy (a file with an item's bytes,
which the index holds once: ``engine.duplicates.byte_copies``) is a member under its item's id and its own
path: it is proposed to be set aside, which moves only its file; keeping it while setting its item's file
aside hands the item to the copy's path (same id and vector). Nothing is ever deleted:

- a file is moved by a hard link at the new name, then the old name unlinked (never overwriting
  anything: a link fails if the name is taken), so at any instant the bytes have one or two names;
- every step can be repeated, so an apply killed at any point can be run again, or undone, from the
  files alone: a file already in the trash is skipped, an item already removed is not removed twice;
- a file whose bytes changed since the plan was written is left where it is, and reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from engine.build.indexing import add_images
from engine.decode.images import decode_image, image_header
from engine.duplicates.byte_copies import find_byte_copies
from engine.duplicates.tiers import (
    Evidence,
    Tier,
    TieredDuplicates,
    TieredGroup,
    TierSettings,
    find_tiered,
    with_byte_copies,
)
from engine.gallery.hashing import file_hash, label_of
from engine.model.embedder import Embedder
from foundation.atomic import atomic_write_text
from foundation.defaults import TRASH_FOLDER
from foundation.errors import ErrorKind, InvalidInputError
from foundation.names import readable_name
from foundation.regular_files import is_regular, read_image_file
from index.gallery import GalleryIndex
from index.manifest import Manifest
from index.protocol import Item, Move

PLAN_VERSION = 1
KEEP, SET_ASIDE = "keep", "set_aside"
ACTIONS = (KEEP, SET_ASIDE)
KEEPER_KEYS = ("pixels", "bytes", "date")  # the keeper rule: each key in turn breaks the previous key's ties
KEEPER_RULE = KEEPER_KEYS  # the default order


@dataclass(frozen=True)
class FileFacts:
    """What the keeper rule compares."""

    pixels: int  # 0 where the file cannot be read
    size: int
    date: str  # when the photo was taken, else when it was indexed


def file_facts(root: Path | None, item: Item) -> FileFacts:
    """``root`` None: an index without a gallery folder, whose files cannot be looked at."""
    size, pixels = 0, 0  # a file that cannot be read now wins by no size
    if root is not None:
        path = root / item.path
        with image_header(path) as image:
            if image is not None:
                size, pixels = path.stat().st_size, image.width * image.height
    return FileFacts(pixels, size, item.taken or item.added)


def check_rule(rule: Sequence[str]) -> tuple[str, ...]:
    unknown = [key for key in rule if key not in KEEPER_KEYS]
    if unknown or len(set(rule)) != len(rule) or not rule:
        raise InvalidInputError(
            f"a keeper rule is an order of {', '.join(KEEPER_KEYS)} without repeats, got {','.join(rule)}"
        )
    return tuple(rule)


def keeper(members: Sequence[tuple[int, FileFacts]], rule: Sequence[str] = KEEPER_RULE) -> int:
    """The id to keep: the best by each key of ``rule`` in turn (most pixels, largest file, earliest
    date), then the smallest id."""

    def rank(member: tuple[int, FileFacts]) -> tuple:
        item_id, facts = member
        by = {"pixels": -facts.pixels, "bytes": -facts.size, "date": facts.date}
        return (*(by[key] for key in rule), item_id)

    return min(members, key=rank)[0]


def pixel_digests(root: Path) -> Callable[[Sequence[Item]], dict[int, str]]:
    """Reads items' decoded pixels (EXIF orientation applied) as a SHA-256 of size and RGB bytes."""

    def digests(items: Sequence[Item]) -> dict[int, str]:
        found = {}
        for item in items:
            try:
                image = decode_image(read_image_file(root / item.path))
            except Exception:  # unreadable or gone: no digest, so never an exact copy by pixels
                continue
            digest = hashlib.sha256(f"{image.width}x{image.height}".encode())
            digest.update(image.tobytes())
            found[item.id] = digest.hexdigest()
        return found

    return digests


def pair_groups(index: GalleryIndex, tier: Tier, settings: TierSettings | None = None) -> TieredDuplicates:
    """The groups of ``tier`` joined by pairs of items (pixel digests read from the gallery folder, when
    the index records one)."""
    root = index.manifest.gallery_root
    return find_tiered(index, tier, settings, digests=pixel_digests(Path(root)) if root else None)


def review_groups(index: GalleryIndex, found: TieredDuplicates) -> TieredDuplicates:
    """``found`` (:func:`pair_groups`) with the files of the gallery folder that have an item's bytes, as
    they are now (the folder may change without the index)."""
    root = index.manifest.gallery_root
    if root is None:
        return found
    return with_byte_copies(found, find_byte_copies(Path(root), index.items.scan()))


@dataclass(frozen=True)
class Member:
    """One image of a group: an item, or a byte copy of one (the item's id, the copy's path)."""

    item: Item
    evidence: Evidence
    byte_copy: bool


def group_members(group: TieredGroup, items: dict[int, Item]) -> list[Member]:
    """The group's items (those still in ``items``), then the byte copies of them."""
    members = [
        Member(items[int(i)], evidence, False)
        for i, evidence in zip(group.ids, group.evidence, strict=True)
        if int(i) in items
    ]
    members += [
        Member(replace(items[copy.of], path=copy.path), copy.evidence, True)
        for copy in group.copies
        if copy.of in items
    ]
    return members


def propose(
    members: Sequence[Member], root: Path | None, rule: Sequence[str] = KEEPER_RULE
) -> tuple[list[FileFacts], list[str]]:
    """Each member's facts and the keeper rule's action: one item kept (a byte copy ties with its item,
    and the index names the item), every other member set aside."""
    facts = [file_facts(root, member.item) for member in members]
    items = [(m.item.id, fact) for m, fact in zip(members, facts, strict=True) if not m.byte_copy]
    chosen = keeper(items, rule) if items else None
    actions = [KEEP if not m.byte_copy and m.item.id == chosen else SET_ASIDE for m in members]
    return facts, actions


def make_plan(
    found: TieredDuplicates,
    items: dict[int, Item],
    *,
    index_dir: Path,
    root: Path,
    rule: Sequence[str] = KEEPER_RULE,
) -> dict:
    """A plan with the keeper rule's proposal: the keeper ``keep``, every other member ``set_aside``."""
    rule = check_rule(rule)
    groups = []
    for group in found.groups:
        members = group_members(group, items)
        if len(members) < 2:
            continue
        facts, actions = propose(members, root, rule)
        groups.append(
            {
                "tier": group.tier.label,
                "keeper": next(m.item.id for m, a in zip(members, actions, strict=True) if a == KEEP),
                "members": [
                    {
                        "id": member.item.id,
                        "path": member.item.path,
                        "content_hash": member.item.content_hash,
                        "byte_copy": member.byte_copy,
                        "pixels": fact.pixels,
                        "bytes": fact.size,
                        "date": fact.date,
                        "action": action,
                        "evidence": {
                            "pairs_with": member.evidence.other,
                            "tier": member.evidence.tier.label,
                            "signature_bits": member.evidence.bits,
                            "cosine": round(member.evidence.cosine, 6),
                            "hash": member.evidence.digest,
                        },
                    }
                    for member, fact, action in zip(members, facts, actions, strict=True)
                ],
            }
        )
    return {
        "version": PLAN_VERSION,
        "plan_id": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ-") + secrets.token_hex(4),
        "index": str(index_dir.resolve()),
        "gallery": str(root),
        "tier": found.tier.label,
        "criteria": found.criteria,
        "keeper_rule": list(rule),
        "groups": groups,
    }


def write_plan(plan: dict, path: Path) -> None:
    atomic_write_text(path, json.dumps(plan, indent=2) + "\n")


class PlanError(InvalidInputError):
    """A plan that cannot be applied as written: the message says where."""

    code = "invalid_plan"


class PlanMemberNotAFileError(PlanError):
    """A member to set aside names a folder, a FIFO or a device of the gallery: a plan at odds with the
    gallery (a label folder took the name since), not a malformed one."""

    kind = ErrorKind.CONFLICT
    code = "not_a_file"


@dataclass(frozen=True)
class SetAside:
    id: int
    path: str
    content_hash: str
    heir: str | None = None  # a kept byte copy that takes the item over when ``path`` is the item's file


def read_plan(plan: dict) -> tuple[str, list[SetAside]]:
    """The plan id and the members to set aside; refuses a malformed plan or a group left without a
    keeper (applying it would set aside every copy of the image)."""
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise PlanError(f"not a duplicates plan of version {PLAN_VERSION}")
    plan_id = plan.get("plan_id")
    if not isinstance(plan_id, str) or not plan_id or "/" in plan_id or plan_id.startswith("."):
        raise PlanError("the plan has no valid plan_id")
    aside = []
    for number, group in enumerate(plan.get("groups") or [], start=1):
        members = group.get("members") if isinstance(group, dict) else None
        if not isinstance(members, list) or not members:
            raise PlanError(f"group {number} has no members")
        actions = [member.get("action") if isinstance(member, dict) else None for member in members]
        if any(action not in ACTIONS for action in actions):
            raise PlanError(f"group {number}: every member's action must be one of {', '.join(ACTIONS)}")
        if KEEP not in actions:
            raise PlanError(f"group {number} keeps no image: mark one member {KEEP!r}")
        kept = {
            member.get("id"): member.get("path") for member in members if member["action"] == KEEP
        }  # a kept member sharing a set-aside member's id is a byte copy of it, or the same file
        for member in members:
            if member["action"] != SET_ASIDE:
                continue
            path = member.get("path")
            if not isinstance(path, str) or not _inside(path):
                raise PlanError(f"group {number}: {path!r} is not a path inside the gallery")
            if not isinstance(member.get("id"), int) or not isinstance(member.get("content_hash"), str):
                raise PlanError(f"group {number}: {path} needs its id and content_hash")
            heir = kept.get(member["id"])
            if heir == path:
                raise PlanError(f"group {number}: {path} is both kept and set aside")
            if heir is not None and (not isinstance(heir, str) or not _inside(heir)):
                raise PlanError(f"group {number}: {heir!r} is not a path inside the gallery")
            aside.append(SetAside(member["id"], path, member["content_hash"], heir))
    return plan_id, aside


def _inside(relative: str) -> bool:
    parts = Path(relative).parts
    return bool(parts) and not Path(relative).is_absolute() and ".." not in parts and parts[0] != TRASH_FOLDER


@dataclass
class ReviewReport:
    moved: list[str] = field(default_factory=list)  # files moved this time
    already: list[str] = field(default_factory=list)  # found where this step puts them (a re-run)
    left: list[tuple[str, str]] = field(default_factory=list)  # (path, why) not moved
    removed: int = 0  # items removed from the index
    handed: int = 0  # items whose file was set aside, now named by a kept byte copy
    reindexed: int = 0  # items indexed again


def _move(source: Path, target: Path) -> None:
    """Give ``source``'s file the name ``target`` and drop the old name, never overwriting a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)  # FileExistsError if the name is taken
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: an atomic rename after the check
        if target.exists():
            raise FileExistsError(target) from None
        os.rename(source, target)
        return
    _fsync_dir(target.parent)
    source.unlink()
    _fsync_dir(source.parent)


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _same_file(first: Path, second: Path) -> bool:
    return first.exists() and second.exists() and os.path.samefile(first, second)


def move_aside(
    root: Path, plan_id: str, members: Sequence[SetAside], on_move: Callable[[str], None] | None = None
) -> ReviewReport:
    """Move each member's file into the trash (see the module's doc); repeatable."""
    report = ReviewReport()
    trash = root / TRASH_FOLDER / plan_id
    # Before any move: a member that names a folder, a FIFO or a device is a wrong plan, not a file to hash.
    for member in members:
        source = root / member.path
        if source.exists() and not is_regular(source):
            raise PlanMemberNotAFileError(
                f"{readable_name(member.path)} is not a regular file in the gallery: nothing was set aside"
            )
    for member in members:
        source, target = root / member.path, trash / member.path
        if _same_file(source, target):  # killed between the link and the unlink
            source.unlink()
            report.moved.append(member.path)
        elif target.exists() and not source.exists():
            report.already.append(member.path)
        elif not source.exists():
            report.left.append((member.path, "not found in the gallery or the trash"))
        elif target.exists():
            report.left.append((member.path, f"{target} exists already"))
        elif file_hash(source) != member.content_hash:
            report.left.append((member.path, "changed since the plan was written"))
        else:
            _move(source, target)
            report.moved.append(member.path)
        if on_move is not None and member.path in report.moved:
            on_move(member.path)
    return report


def move_back(root: Path, plan_id: str, members: Sequence[SetAside]) -> ReviewReport:
    """Move each member's file from the trash back to its place; repeatable."""
    report = ReviewReport()
    trash = root / TRASH_FOLDER / plan_id
    for member in members:
        source, target = trash / member.path, root / member.path
        if _same_file(source, target):
            source.unlink()
            report.moved.append(member.path)
        elif target.exists() and not source.exists():
            report.already.append(member.path)
        elif not source.exists():
            report.left.append((member.path, "not found in the trash or the gallery"))
        elif target.exists():
            report.left.append((member.path, "another file took its place: it stays in the trash"))
        else:
            _move(source, target)
            report.moved.append(member.path)
    return report


def gallery_root(index_dir: Path) -> Path:
    root = Manifest.load(index_dir).gallery_root
    if root is None:
        raise PlanError(f"{index_dir} records no gallery folder: its images cannot be set aside")
    return Path(root)


def set_aside(index: GalleryIndex, plan: dict, on_move: Callable[[str], None] | None = None) -> ReviewReport:
    """Set aside the plan's non-keepers in an open index: files into the trash, then their items out of
    the index, which is saved."""
    plan_id, aside = read_plan(plan)
    if index.manifest.gallery_root is None:
        raise PlanError("the index records no gallery folder: its images cannot be set aside")
    root = Path(index.manifest.gallery_root)
    report = move_aside(root, plan_id, aside, on_move)
    in_trash = [member for member in aside if member.path in {*report.moved, *report.already}]
    stored = index.items.get_many([member.id for member in in_trash])
    # Only a member that is its item's file: a byte copy's item stays, and an id whose item now has
    # another path was indexed again since (an undo) or handed to a copy (a re-run): not this plan's.
    own = [m for m in in_trash if m.id in stored and stored[m.id].path == m.path]
    heirs = [Move(m.id, m.heir, label_of(m.heir)) for m in own if m.heir and _holds(root / m.heir, m)]
    handed = {heir.id for heir in heirs}
    removed = [m.id for m in own if m.id not in handed]
    if heirs:
        report.handed = index.move(heirs)
    if removed:
        report.removed = index.remove(removed)
    if heirs or removed:
        index.save()
    return report


def _holds(path: Path, member: SetAside) -> bool:
    """Whether ``path`` (a kept byte copy) still has the bytes of the member's item."""
    try:
        return file_hash(path) == member.content_hash
    except OSError:
        return False


def apply_plan(index_dir: Path, plan: dict, on_move: Callable[[str], None] | None = None) -> ReviewReport:
    """:func:`set_aside` on the index in ``index_dir``."""
    read_plan(plan)  # a bad plan is refused before the index is opened
    index = GalleryIndex.open(index_dir)
    try:
        return set_aside(index, plan, on_move)
    finally:
        index.close()


def undo_plan(index_dir: Path, plan: dict, embedder: Embedder, *, progress: bool = False) -> ReviewReport:
    """Put the plan's set-aside files back and index them again (those still indexed stay as they are)."""
    plan_id, aside = read_plan(plan)
    root = gallery_root(index_dir)
    report = move_back(root, plan_id, aside)
    back = [root / path for path in (*report.moved, *report.already)]
    if back:
        built = add_images(index_dir, embedder, back, progress=progress)
        report.reindexed = built.indexed
    return report
