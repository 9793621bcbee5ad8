"""Reviewing duplicate groups: a keeper per group, a plan on disk, and applying or undoing it safely.

A plan (JSON) lists each group with its tier, evidence and members; each member is ``keep`` or
``set_aside``. The keeper rule (``engine.gallery.keeper``: the source of the copies, not the largest
file) proposes one keeper per group, with the reason it was chosen; a similar group keeps every member
(another take of a scene is no duplicate). A person may edit the plan. Applying it writes the plan into
``TRASH_FOLDER/<plan id>/`` inside the gallery (``PLAN_FILE``: an undo needs nothing else), moves each
set-aside file there (same relative path), keeps the items it removes from the index (``ITEMS_FILE``:
vectors, signatures and metadata; the judgments naming them in ``JUDGMENTS_FILE``) and removes them;
undoing moves the files back and puts their items, and those judgments, back under their ids (a file
changed in the trash, or an index that takes no ids, is indexed again), then, where every file is back,
removes what the apply made: those three files and the emptied folders, up to the trash folder itself when
no other apply is in it. An undo leaves no trace, and never deletes a file it did not make: a trash folder
holding anything else (a file that could not go back, a file someone put there) is left whole. A
byte copy (a file with an item's bytes, which the index holds once: ``engine.duplicates.byte_copies``) is a
member under its item's id and its own path, ranked by the keeper rule like any file: setting it aside
moves only its file; keeping it while setting its item's file aside hands the item to the copy's path
(same id and vector). Nothing is ever deleted:

- a file is moved by a hard link at the new name, then the old name unlinked (never overwriting
  anything: a link fails if the name is taken), so at any instant the bytes have one or two names;
- every step can be repeated, so an apply killed at any point can be run again, or undone, from the
  files alone: a file already in the trash is skipped, an item already removed is not removed twice;
- a file whose bytes changed since the plan was written is left where it is, and reported.

A delete (``DELETE /v1/items/{id}``, ``dmlsearch index remove``: :func:`delete_items`) is a plan of its own,
applied at once: its ``deleted`` members (the item's file and every byte copy of it, which would otherwise
be indexed again in its place) are set aside with no keeper, since a person named them. So a deleted photo
stays deleted through every later ``build-index`` and ``watch`` of the folder, and the same undo restores
it, with its id and judgments where the index takes ids. The photo itself is the record: a user who puts
it back into the folder on purpose gets it indexed again.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeGuard

import numpy as np

from engine.build.report import BuildReport
from engine.build.sync import sync_files
from engine.decode.images import pixel_digest
from engine.decode.pool import Decoder, InProcessDecoder
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
from engine.gallery.keeper import FileFacts, GroupVectors, check_rule, choose_keeper, file_facts
from engine.model.embedder import Embedder
from foundation.atomic import atomic_write_bytes, atomic_write_text
from foundation.defaults import BATCH_SIZE, KEEPER_RULE, PLAN_BYTES, TRASH_FOLDER
from foundation.errors import ErrorKind, InvalidInputError, NotFoundError
from foundation.names import readable_name
from foundation.regular_files import is_regular, read_regular
from index.gallery import GalleryIndex
from index.judgments import Judgment, as_record, from_record
from index.manifest import Manifest
from index.protocol import Entry, Item, Move

PLAN_VERSION = 1
KEEP, SET_ASIDE = "keep", "set_aside"
ACTIONS = (KEEP, SET_ASIDE)
# In the trash folder of a plan (names no image file has: they are not images).
PLAN_FILE = ".dmlsearch-plan.json"  # the plan as applied: what an undo reads
ITEMS_FILE = ".dmlsearch-items.npz"  # the items the apply removed, so that an undo keeps their ids
JUDGMENTS_FILE = ".dmlsearch-judgments.jsonl"  # the judgments deleted with them, for the undo to restore
SIMILAR_REASON = "similar, not duplicate: every image is kept unless you untick it"


def pixel_digests(root: Path, decoder: Decoder) -> Callable[[Sequence[Item]], dict[int, str]]:
    """Reads items' decoded pixels (:func:`engine.decode.images.pixel_digest`) through ``decoder``, which
    is given each file's path (a server's decode process reads it: gallery files are untrusted input)."""

    def digests(items: Sequence[Item]) -> dict[int, str]:
        found = {}
        for item in items:
            try:
                found[item.id] = decoder.run(pixel_digest, root / item.path)
            except Exception:  # unreadable, gone or over a limit: no digest, so never an exact copy by pixels
                continue
        return found

    return digests


def pair_groups(
    index: GalleryIndex,
    tier: Tier,
    settings: TierSettings | None = None,
    decoder: Decoder | None = None,
) -> TieredDuplicates:
    """The groups of ``tier`` joined by pairs of items (pixel digests read from the gallery folder, when
    the index records one, through ``decoder``: None decodes here)."""
    root = index.manifest.gallery_root
    digests = pixel_digests(Path(root), decoder or InProcessDecoder()) if root else None
    return find_tiered(index, tier, settings, digests=digests)


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


@dataclass(frozen=True)
class Proposal:
    """The keeper rule's proposal for a group's members (in order)."""

    facts: list[FileFacts]
    actions: list[str]  # keep or set_aside, one per member
    keeper: int | None  # the kept member's position (None: every member kept, a similar group)
    reason: str  # why, in words


def propose(
    tier: Tier,
    members: Sequence[Member],
    root: Path | None,
    rule: Sequence[str] = KEEPER_RULE,
    vectors: GroupVectors | None = None,
) -> Proposal:
    """Each member's facts and the keeper rule's action (``engine.gallery.keeper``): one member kept,
    a byte copy as well as an item, every other set aside; in a similar group, every member kept.
    ``vectors``: tell the group's label folder and centre (None: those keys tie)."""
    facts = [
        file_facts(root / m.item.path if root else None, label_of(m.item.path), m.item.taken or m.item.added)
        for m in members
    ]
    if tier is Tier.SIMILAR:
        return Proposal(facts, [KEEP] * len(members), None, SIMILAR_REASON)
    ids = sorted({m.item.id for m in members})
    home = vectors.home_folder(ids, [fact.label for fact in facts]) if vectors else None
    centrality = vectors.centrality([m.item.id for m in members]) if vectors else None
    choice = choose_keeper(facts, home, rule, centrality)
    actions = [KEEP if position == choice.keeper else SET_ASIDE for position in range(len(members))]
    return Proposal(facts, actions, choice.keeper, choice.reason)


def make_plan(
    found: TieredDuplicates,
    index: GalleryIndex,
    *,
    index_dir: Path,
    root: Path,
    rule: Sequence[str] = KEEPER_RULE,
) -> dict:
    """A plan with the keeper rule's proposal (:func:`propose`) for each group of ``found`` (of the open
    ``index``), and the reason for each keeper."""
    rule = check_rule(rule)
    items = index.items.get_many([int(i) for group in found.groups for i in group.ids])
    vectors = GroupVectors(index)
    groups = []
    for group in found.groups:
        members = group_members(group, items)
        if len(members) < 2:
            continue
        proposal = propose(group.tier, members, root, rule, vectors)
        kept = None if proposal.keeper is None else members[proposal.keeper].item
        groups.append(
            {
                "tier": group.tier.label,
                "keeper": None if kept is None else kept.id,
                "keeper_path": None if kept is None else kept.path,
                "reason": proposal.reason,
                "members": [
                    {
                        "id": member.item.id,
                        "path": member.item.path,
                        "content_hash": member.item.content_hash,
                        "byte_copy": member.byte_copy,
                        "width": fact.width,
                        "height": fact.height,
                        "pixels": fact.pixels,
                        "bytes": fact.size,
                        "camera": fact.camera,
                        "date": fact.date,
                        "dated_by": fact.dated_by,
                        "action": action,
                        "evidence": {
                            "pairs_with": member.evidence.other,
                            "tier": member.evidence.tier.label,
                            "signature_bits": member.evidence.bits,
                            "cosine": round(member.evidence.cosine, 6),
                            "hash": member.evidence.digest,
                        },
                    }
                    for member, fact, action in zip(members, proposal.facts, proposal.actions, strict=True)
                ],
            }
        )
    return {
        "version": PLAN_VERSION,
        "plan_id": _new_plan_id(),
        "index": str(index_dir.resolve()),
        "gallery": str(root),
        "tier": found.tier.label,
        "criteria": found.criteria,
        "keeper_rule": list(rule),
        "groups": groups,
    }


def _new_plan_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ-") + secrets.token_hex(4)


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
    keeper (applying it would set aside every copy of the image). A delete's members (``deleted``) have
    no keeper: a person named them."""
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise PlanError(f"not a duplicates plan of version {PLAN_VERSION}")
    plan_id = plan.get("plan_id")
    if not _plan_id_ok(plan_id):
        raise PlanError("the plan has no valid plan_id")
    aside = []
    deleted = plan.get("deleted") or []
    if not isinstance(deleted, list) or not all(isinstance(member, dict) for member in deleted):
        raise PlanError("deleted must be a list of members")
    for member in deleted:
        path = member.get("path")
        if not isinstance(path, str) or not _inside(path):
            raise PlanError(f"deleted: {path!r} is not a path inside the gallery")
        if not isinstance(member.get("id"), int) or not isinstance(member.get("content_hash"), str):
            raise PlanError(f"deleted: {path} needs its id and content_hash")
        aside.append(SetAside(member["id"], path, member["content_hash"]))
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
    restored: int = 0  # items put back under their ids (an undo)
    reindexed: int = 0  # files indexed again, under new ids (an undo)


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


def _require_files(root: Path, members: Sequence[SetAside]) -> None:
    """Refuse a plan whose member names a folder, a FIFO or a device: a wrong plan, not a file to hash."""
    for member in members:
        source = root / member.path
        if source.exists() and not is_regular(source):
            raise PlanMemberNotAFileError(
                f"{readable_name(member.path)} is not a regular file in the gallery: nothing was set aside"
            )


def move_aside(
    root: Path, plan_id: str, members: Sequence[SetAside], on_move: Callable[[str], None] | None = None
) -> ReviewReport:
    """Move each member's file into the trash (see the module's doc); repeatable."""
    report = ReviewReport()
    trash = root / TRASH_FOLDER / plan_id
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


def _root(index: GalleryIndex) -> Path:
    if index.manifest.gallery_root is None:
        raise PlanError("the index records no gallery folder: its images cannot be set aside")
    return Path(index.manifest.gallery_root)


def read_plan_file(path: Path) -> dict:
    """The plan in the file ``path``; a file that is no JSON is refused with where it breaks."""
    try:
        text = read_regular(path, PLAN_BYTES).decode()  # a FIFO or a device is refused, not waited on
    except (OSError, UnicodeDecodeError) as err:
        raise PlanError(f"cannot read the plan {path}: {err}") from None
    try:
        plan = json.loads(text)
    except ValueError as err:
        where = (
            f" (line {err.lineno}, column {err.colno}: {err.msg})"
            if isinstance(err, json.JSONDecodeError)
            else ""
        )
        raise PlanError(
            f"{path} is not a duplicates plan: it is not valid JSON{where}; write one with "
            "dmlsearch duplicates --plan"
        ) from None
    read_plan(plan)  # refused here, naming the file's fault, rather than half-way through
    return plan


def find_plan(root: Path, given: str) -> dict:
    """The applied plan ``given`` names: a plan file, the trash folder of an apply (which holds its plan;
    as given or inside the gallery ``root``) or a plan id (:func:`applied_plan`)."""
    for candidate in (Path(given), root / given):
        if candidate.is_dir():
            candidate = candidate / PLAN_FILE
        if candidate.is_file():
            return read_plan_file(candidate)
    return applied_plan(root, given)


def applied_plan(root: Path, plan_id: str) -> dict:
    """The plan an apply wrote into its trash folder in the gallery ``root``."""
    path = root / TRASH_FOLDER / plan_id / PLAN_FILE
    if not _plan_id_ok(plan_id) or not path.is_file():
        raise PlanNotFoundError(
            f"{plan_id} is no plan file, and no trash folder ({TRASH_FOLDER}/<plan id>) or plan id of an "
            f"apply in {root}"
        )
    return read_plan_file(path)


class PlanNotFoundError(NotFoundError):
    """No plan at the path, trash folder or plan id given for an undo."""

    code = "plan_not_found"


def _plan_id_ok(plan_id: object) -> TypeGuard[str]:
    return isinstance(plan_id, str) and bool(plan_id) and "/" not in plan_id and not plan_id.startswith(".")


@dataclass(frozen=True)
class KeptItem:
    """An item an apply removed, as the index held it: an undo puts it back under its id."""

    item: Item
    vector: np.ndarray
    signature: bytes | None


def _kept_items(trash: Path) -> dict[int, KeptItem]:
    path = trash / ITEMS_FILE
    if not path.is_file():
        return {}
    with np.load(path, allow_pickle=False) as stored:
        rows = json.loads(str(stored["items"]))
        vectors = stored["vectors"]
    return {
        row["id"]: KeptItem(
            Item(row["id"], row["path"], row["label"], row["content_hash"], row["added"], row["taken"]),
            vector,
            None if row["signature"] is None else bytes.fromhex(row["signature"]),
        )
        for row, vector in zip(rows, vectors, strict=True)
    }


def _kept_judgments(trash: Path) -> dict[int, Judgment]:
    path = trash / JUDGMENTS_FILE
    if not path.is_file():
        return {}
    judgments = (from_record(json.loads(line)) for line in path.read_text().splitlines())
    return {judgment.id: judgment for judgment in judgments}


def _keep_judgments(index: GalleryIndex, trash: Path, ids: Sequence[int]) -> None:
    """Write the judgments naming the items about to be removed (deleted with them) into the trash's
    ``JUDGMENTS_FILE``, with those of an earlier run of the same plan."""
    removed = set(ids)
    kept = _kept_judgments(trash)
    for judgment in index.judgments.scan():
        if judgment.result in removed or judgment.query.item in removed:
            kept[judgment.id] = judgment
    if kept:
        lines = [json.dumps(as_record(judgment)) + "\n" for _, judgment in sorted(kept.items())]
        atomic_write_text(trash / JUDGMENTS_FILE, "".join(lines))


def _restore_judgments(index: GalleryIndex, trash: Path) -> None:
    """Put back the kept judgments whose items are all in the index again (under their ids)."""
    kept = list(_kept_judgments(trash).values())
    named = {j.result for j in kept} | {j.query.item for j in kept if j.query.item is not None}
    present = index.items.get_many(sorted(named))
    index.judgments.copy_in(
        [j for j in kept if j.result in present and (j.query.item is None or j.query.item in present)]
    )


def _keep_items(index: GalleryIndex, trash: Path, ids: Sequence[int]) -> None:
    """Write the items about to be removed into the trash's ``ITEMS_FILE`` (with those of an earlier run
    of the same plan), before they are removed."""
    kept = _kept_items(trash)
    stored = index.items.get_many([i for i in ids if i not in kept])
    if not stored:
        return
    new = sorted(stored)
    signatures = index.signatures(new)
    for item_id, vector in zip(new, index.vectors(new), strict=True):
        kept[item_id] = KeptItem(stored[item_id], vector, signatures.get(item_id))
    rows = [
        {**asdict(entry.item), "signature": None if entry.signature is None else entry.signature.hex()}
        for entry in kept.values()
    ]
    buffer = io.BytesIO()
    np.savez(buffer, items=np.array(json.dumps(rows)), vectors=np.stack([e.vector for e in kept.values()]))
    atomic_write_bytes(trash / ITEMS_FILE, buffer.getvalue())


def set_aside(index: GalleryIndex, plan: dict, on_move: Callable[[str], None] | None = None) -> ReviewReport:
    """Set aside the plan's non-keepers in an open index: the plan into its trash folder, files into it,
    then their items out of the index (kept in the trash folder for an undo), which is saved."""
    plan_id, aside = read_plan(plan)
    root = _root(index)
    _require_files(root, aside)  # before anything is written or moved
    trash = root / TRASH_FOLDER / plan_id
    trash.mkdir(parents=True, exist_ok=True)
    atomic_write_text(trash / PLAN_FILE, json.dumps(plan, indent=2) + "\n")  # first: an undo needs it
    report = move_aside(root, plan_id, aside, on_move)
    in_trash = [member for member in aside if member.path in {*report.moved, *report.already}]
    stored = index.items.get_many([member.id for member in in_trash])
    # Only a member that is its item's file: a byte copy's item stays, and an id whose item now has
    # another path was indexed again since (an undo) or handed to a copy (a re-run): not this plan's.
    own = [m for m in in_trash if m.id in stored and stored[m.id].path == m.path]
    heirs = [
        Move(m.id, m.heir, label_of(m.heir)) for m in own if m.heir and _holds(root / m.heir, m.content_hash)
    ]
    handed = {heir.id for heir in heirs}
    removed = [m.id for m in own if m.id not in handed]
    if heirs:
        report.handed = index.move(heirs)
    if removed:
        _keep_items(index, trash, removed)
        _keep_judgments(index, trash, removed)
        report.removed = index.remove(removed)
    if heirs or removed:
        index.save()
    return report


def deletion_plan(index: GalleryIndex, items: Sequence[Item], root: Path) -> dict:
    """The plan of deleting ``items`` of ``index`` (gallery folder ``root``): each item's file and every
    byte copy of it set aside (a copy left in the folder would be indexed again in its place)."""
    copies = find_byte_copies(root, items)
    members = [
        {"id": item.id, "path": path, "content_hash": item.content_hash}
        for item in items
        for path in [item.path, *(copy.path for copy in copies.get(item.id, []))]
    ]
    return {
        "version": PLAN_VERSION,
        "plan_id": _new_plan_id(),
        "index": str(index.directory.resolve()),
        "gallery": str(root),
        "reason": "deleted: set aside so that no build or watch of the folder indexes them again",
        "groups": [],
        "deleted": members,
    }


@dataclass(frozen=True)
class Deletion:
    plan_id: str | None  # undoes it (None: the index records no gallery folder, so nothing was set aside)
    report: ReviewReport


def delete_items(index: GalleryIndex, ids: Sequence[int]) -> Deletion:
    """Delete the items ``ids`` (those indexed) of an open index so that they stay deleted: their files,
    and byte copies of them, set aside into the trash (:func:`deletion_plan`, :func:`set_aside`: the items
    and their judgments kept there for the undo), the items removed and the index saved. An item whose
    file is gone from the folder, or changed since it was indexed (another photo now, which the next
    build indexes), is removed as it is. A folder that cannot be written refuses the delete (OSError)
    before any item is removed: a delete that the next build undid would be no delete."""
    items = index.items.get_many(ids)
    root = index.manifest.gallery_root
    if root is None:  # no folder that could bring them back
        report = ReviewReport(removed=index.remove(sorted(items)))
        index.save()
        return Deletion(None, report)
    plan = deletion_plan(index, list(items.values()), Path(root))
    try:
        report = set_aside(index, plan)
    except BaseException:
        _take_back(Path(root), plan)  # the index refused the removal: the photos go back where they were
        raise
    left = sorted(index.items.get_many(sorted(items)))
    if left:
        report.removed += index.remove(left)
        index.save()
    return Deletion(plan["plan_id"], report)


def _take_back(root: Path, plan: dict) -> None:
    """Undo a delete's moves after its index refused the removal (a read-only or locked index): every file
    back in place, then the delete's trash folder (its plan and kept items, nothing else) removed."""
    plan_id, aside = read_plan(plan)
    report = move_back(root, plan_id, aside)
    if report.left:  # a file could not go back: the trash keeps it, with the plan an undo reads
        return
    shutil.rmtree(root / TRASH_FOLDER / plan_id, ignore_errors=True)
    with contextlib.suppress(OSError):  # the trash folder itself, unless another plan is in it
        (root / TRASH_FOLDER).rmdir()


def _holds(path: Path, content_hash: str) -> bool:
    """Whether ``path`` still has the bytes whose hash is ``content_hash``."""
    try:
        return file_hash(path) == content_hash
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


def put_back(index: GalleryIndex, plan: dict, embedder: Embedder, *, progress: bool = False) -> ReviewReport:
    """Undo an applied plan in an open index: its set-aside files back in place, and their items back
    under their ids (kept by the apply); a file whose bytes changed in the trash, or an index that takes
    no items under given ids (Milvus), is indexed again. Items still indexed stay as they are (a byte
    copy's item, an item handed to a kept copy). The judgments deleted with the items come back with them
    (those whose items are all back under their ids). The index is built and saved."""
    plan_id, aside = read_plan(plan)
    root = _root(index)
    trash = root / TRASH_FOLDER / plan_id
    report = move_back(root, plan_id, aside)
    back = [*report.moved, *report.already]
    kept = {entry.item.path: entry for entry in _kept_items(trash).values()}
    restored = [
        entry
        for path in back
        if (entry := kept.get(path)) is not None
        and index.capabilities.mergeable
        and index.items.get(entry.item.id) is None
        and index.items.get_by_path(path) is None
        and _holds(root / path, entry.item.content_hash)
    ]
    if restored:
        index.copy_in(
            np.stack([entry.vector for entry in restored]),
            [Entry(e.item.path, e.item.label, e.item.content_hash, e.item.taken) for e in restored],
            [entry.signature for entry in restored],
            added=[entry.item.added for entry in restored],
            ids=[entry.item.id for entry in restored],
        )
        _restore_judgments(index, trash)
    again = {entry.item.path for entry in restored}
    embed = [root / path for path in back if path not in again]
    built = BuildReport()
    if embed:
        sync_files(
            index,
            root,
            embed,
            embedder,
            built,
            gone=lambda _: False,
            batch_size=BATCH_SIZE,
            progress=progress,
        )
    report.restored, report.reindexed = len(restored), built.indexed
    if back:
        index.build(retune=False, progress=progress)
        index.save()
    if not report.left:
        _remove_trash(root, plan_id)
    return report


APPLY_FILES = (PLAN_FILE, ITEMS_FILE, JUDGMENTS_FILE)  # what an apply writes into its trash folder


def _remove_trash(root: Path, plan_id: str) -> None:
    """Remove an undone apply's trash folder (module doc) where it holds only the apply's own files and
    folders (a link is not one of them); the trash folder itself where no other apply's folder is in it.
    A folder something was put into meanwhile stays."""
    trash = root / TRASH_FOLDER / plan_id
    if not trash.is_dir() or trash.is_symlink():
        return
    inside = list(trash.rglob("*"))
    folders = [path for path in inside if path.is_dir() and not path.is_symlink()]
    if any(path not in folders and path.relative_to(trash).as_posix() not in APPLY_FILES for path in inside):
        return
    for name in APPLY_FILES:
        (trash / name).unlink(missing_ok=True)
    for folder in [*sorted(folders, key=lambda path: len(path.parts), reverse=True), trash, trash.parent]:
        with contextlib.suppress(OSError):  # deepest first; one not empty (another apply's) stays
            folder.rmdir()


def undo_plan(index_dir: Path, plan: dict, embedder: Embedder, *, progress: bool = False) -> ReviewReport:
    """:func:`put_back` on the index in ``index_dir``."""
    read_plan(plan)
    index = GalleryIndex.open(index_dir)
    try:
        index.check_model(embedder.fingerprint, embedder.dim)
        return put_back(index, plan, embedder, progress=progress)
    finally:
        index.close()
