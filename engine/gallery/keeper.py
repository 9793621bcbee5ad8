"""The keeper rule: of a group of copies of one image, the file a person keeps is its source.

Copies are made from a source, never the other way round, and each way of making one leaves a trace the
rule reads from the files (never from the bytes on disk: a re-encode at a higher quality is larger than
its source). Each key of the rule, in turn, breaks the ties of the keys before it:

- **camera**: the file that carries the camera's EXIF (its Make or Model): most editors and every
  re-save without care drop it, while a byte copy keeps it;
- **source**: the file the others were derived from by the edits the tiers find (``tiers``): a crop or a
  reduction has fewer pixels and fits inside its source, upright or turned a quarter (a crop then a turn
  too); a turn, a mirror, a re-encode or a colour change keeps the size, and is told by the keys below.
  A copy enlarged beyond its source would be taken for the source: no edit the tiers measure does that;
- **date**: the earliest capture time by the camera's clock (EXIF DateTimeOriginal); files without one
  tie here, after those with one. A file's own time is weak evidence (``touch``, a copy tool or an
  unpacked archive sets it to anything), so it comes last (**file-time**);
- **folder**: the file in its label folder: the one whose other images look most like the group's (the
  mean of the 3 highest cosines between the group's stored vectors and theirs): a photo's class folder,
  not a folder of copies (``edited/``), however many of the group's copies that holds. Images at the
  similar tier's cosine or closer to the group are copies or takes of it, not evidence of what a folder
  holds, and are left out where the folder holds other images: ``edited/`` with a resize, a crop and a
  re-encode of a photo, and edits of other photos, is not the photo's label folder, while a folder of one
  photo and its takes is, and so is a folder of the group's images and nothing else. A folder holding
  nothing but edits of this one photo is taken for its label folder too: the vectors cannot tell it from
  a folder of takes. Where nothing tells the folders apart, the key ties;
- **centre**: the image nearest the others (the highest mean cosine of its stored vector to theirs): each
  copy is one edit away from its source, two copies are two edits apart (a mirror and a warmer copy), so
  the source sits in the middle of its copies. Files of the same bytes share one vector, and tie;
- **file-time**: the earliest file time, where nothing above told the files apart: a copy gets its time
  when it is made (``cp -p`` keeps it: byte copies then tie). File times less than ``FILE_TIME_TIE`` apart
  tie: files written in one go (a folder copied, a download) are dated in the order they were written;
- **pixels** and **bytes** (most, largest) are not in the default rule: bytes do not tell a source from a
  copy; they can be asked for with ``--keep-by``.

Members tied on every key keep their order (an item before its byte copies, then by id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.decode.capture_time import camera_name, capture_time, file_time
from engine.decode.images import image_header
from foundation.defaults import KEEPER_RULE, SIMILAR_COSINE
from foundation.errors import InvalidInputError

if TYPE_CHECKING:
    from index.gallery import GalleryIndex

KEEPER_KEYS = ("camera", "source", "date", "folder", "centre", "file-time", "pixels", "bytes")
# The file-time key: file times closer than this (seconds) tie (see _together); copies made by hand are
# minutes or days younger than their source.
FILE_TIME_TIE = 60
# The folder key: how many of a folder's images closest to the group's are averaged.
FOLDER_NEIGHBOURS = 3


@dataclass(frozen=True)
class FileFacts:
    """What the keeper rule reads from a member's file."""

    width: int  # 0 where the file cannot be read
    height: int
    size: int
    camera: str | None  # the EXIF Make and Model
    date: str  # the capture time (ISO 8601), else the file's time
    dated_by: str  # "camera clock" or "file time"
    label: str | None  # the name of the file's folder

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def fits_in(self, other: FileFacts) -> bool:
        """Whether this file could be a crop or a reduction of ``other``: fewer pixels, and no side
        longer than the other's, upright or turned a quarter."""
        if self.pixels >= other.pixels:
            return False
        upright = self.width <= other.width and self.height <= other.height
        return upright or (self.width <= other.height and self.height <= other.width)


def file_facts(path: Path | None, label: str | None, fallback_date: str) -> FileFacts:
    """``path`` None (an index without a gallery folder) or unreadable: no size, no camera, and
    ``fallback_date`` (when the item was taken or indexed)."""
    if path is not None:
        with image_header(path) as image:
            if image is not None:
                taken = capture_time(image)
                return FileFacts(
                    image.width,
                    image.height,
                    path.stat().st_size,
                    camera_name(image),
                    taken or file_time(path),
                    "camera clock" if taken else "file time",
                    label,
                )
    return FileFacts(0, 0, 0, None, fallback_date, "index", label)


def check_rule(rule: Sequence[str]) -> tuple[str, ...]:
    unknown = [key for key in rule if key not in KEEPER_KEYS]
    if unknown or len(set(rule)) != len(rule) or not rule:
        raise InvalidInputError(
            f"a keeper rule is an order of {', '.join(KEEPER_KEYS)} without repeats, got {','.join(rule)}"
        )
    return tuple(rule)


@dataclass(frozen=True)
class Choice:
    keeper: int  # the position of the kept member
    reason: str  # why, in words


def choose_keeper(
    facts: Sequence[FileFacts],
    home: str | None,
    rule: Sequence[str] = KEEPER_RULE,
    centrality: Sequence[float] | None = None,
) -> Choice:
    """The member to keep (see the module's doc); ``home``: the group's label folder, ``centrality``: each
    member's mean cosine to the others (:class:`GroupVectors`; None: the centre key ties)."""
    derived = [any(f.fits_in(other) for other in facts) for f in facts]
    values: dict[str, list[Any]] = {  # each key's value per member: the lowest is best
        "camera": [f.camera is None for f in facts],
        "source": derived,
        # A capture time before none (a file time is not one: the file-time key reads it).
        "date": [(0, f.date) if f.dated_by == "camera clock" else (1, "") for f in facts],
        "folder": [home is None or f.label != home for f in facts],
        # Rounded: two files of the same bytes share a vector, and float sums must not part them.
        "centre": [-round(c, 4) for c in centrality] if centrality else [0] * len(facts),
        "file-time": [f.date for f in facts],
        "pixels": [-f.pixels for f in facts],
        "bytes": [-f.size for f in facts],
    }
    left = list(range(len(facts)))
    reasons = []
    for key in rule:
        best = min(values[key][i] for i in left)
        kept = [
            i for i in left if values[key][i] == best or (key == "file-time" and _together(facts[i], best))
        ]
        if len(kept) < len(left):
            reasons.append(_reason(key, facts, kept[0], home, len(left) - len(kept)))
            left = kept
        if len(left) == 1:
            break
    if len(left) > 1:
        reasons.append(
            f"ties with {len(left) - 1} other{'s' if len(left) > 2 else ''} on every key: the first listed"
        )
    return Choice(left[0], "; ".join(reasons))


def _together(fact: FileFacts, earliest: str) -> bool:
    """Whether a file's time is within FILE_TIME_TIE of the earliest (a file time too): files written in
    one go (a folder copied without keeping times, a download, an unpacked archive) get times in the order
    they were written, which tells nothing of which is the source."""
    if fact.dated_by != "file time":
        return False
    try:
        apart = datetime.fromisoformat(fact.date) - datetime.fromisoformat(earliest)
    except (TypeError, ValueError):  # a camera clock without its offset against a file time: not comparable
        return False
    return apart.total_seconds() < FILE_TIME_TIE


def _reason(key: str, facts: Sequence[FileFacts], chosen: int, home: str | None, beaten: int) -> str:
    fact = facts[chosen]
    others = f"{beaten} other{'s' if beaten > 1 else ''}"
    if key == "camera":
        return f"has the camera's EXIF ({fact.camera}), {others} not"
    if key == "source":
        return f"the source: {others} fit inside its {fact.width}x{fact.height} (crops or reductions)"
    if key == "date":
        return f"the earliest capture time ({fact.date}, camera clock), before {others}"
    if key == "file-time":
        return (
            f"the earliest file time ({fact.date}, {fact.dated_by}), before {others}: nothing else told "
            "them apart"
        )
    if key == "folder":
        return f"in its label folder {home!r} (whose images look most like it), {others} not"
    if key == "centre":
        return f"the centre of the group (the others look most like it), before {others}"
    if key == "pixels":
        return f"the most pixels ({fact.width}x{fact.height}), more than {others}"
    return f"the largest file ({fact.size} bytes), larger than {others}"


class GroupVectors:
    """What the keeper rule reads from an index's stored vectors: a group's label folder (which of its
    folders holds the images that look most like it) and its members' centrality."""

    def __init__(self, index: GalleryIndex) -> None:
        self.index = index
        self._by_label: dict[str | None, list[int]] | None = None  # read once, on the first question

    def home_folder(self, ids: Sequence[int], labels: Sequence[str | None]) -> str | None:
        """Of ``labels`` (the folders of the group's files), the group's label folder: the one whose other
        images (not ``ids``, the group's items, nor their copies and takes) look most like the group's;
        None where the files are in one folder, or nothing tells the folders apart."""
        folders = set(labels)
        if len(folders) < 2 or not ids:
            return None
        if self._by_label is None:
            self._by_label = {}
            for item in self.index.items.scan():
                self._by_label.setdefault(item.label, []).append(item.id)
        group = set(ids)
        vectors = self.index.vectors(list(ids))
        scores: dict[str | None, float] = {}
        for label in folders:
            items = self._by_label.get(label, [])
            others = [i for i in items if i not in group]
            if not others:  # the group's items and nothing else: the folder is about this photo alone
                scores[label] = 1.0 if items else -2.0  # -2: only byte copies, which have no item
                continue
            closest = (vectors @ self.index.vectors(others).T).max(axis=0)
            # Not the group's copies and takes (module doc), unless the folder holds nothing else.
            evidence = closest[closest < SIMILAR_COSINE] if (closest < SIMILAR_COSINE).any() else closest
            scores[label] = float(np.sort(evidence)[-FOLDER_NEIGHBOURS:].mean())
        ranked = sorted(scores.values(), reverse=True)
        if ranked[0] == ranked[1]:
            return None
        return max(scores, key=lambda label: scores[label])

    def centrality(self, ids: Sequence[int]) -> list[float]:
        """For each of ``ids`` (one per member: a byte copy gives its item's), the mean cosine of its item
        to the group's other items."""
        unique = sorted(set(ids))
        if len(unique) < 2:
            return [0.0] * len(ids)
        cosines = self.index.vectors(unique) @ self.index.vectors(unique).T
        mean = (cosines.sum(axis=1) - cosines.diagonal()) / (len(unique) - 1)
        by_id = dict(zip(unique, mean.tolist(), strict=True))
        return [by_id[item_id] for item_id in ids]
