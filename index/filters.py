"""Which items a search may return: by label, by path prefix (a sub-folder), by when the photo was taken and
by when it was indexed.

One :class:`ItemFilter` is turned into an SQL condition for ``items.sqlite`` (the FAISS backend resolves it
to the set of allowed ids, then searches with a FAISS ``IDSelector``) or into a Milvus filter expression.

Two clocks, because a photo library is asked both "what did I shoot in June" and "what came in since
Monday". ``taken_*`` compare the camera's clock (``Item.taken``: "2024-06-01T18:30:00", plus "+02:00" where
the offset is known), as a photo library shows it: a photo taken at 00:30 in Tokyo on 1 June is a 1 June
photo, whatever UTC says. Stored values start with that clock time in a fixed form, so plain string
comparison against a bound without a zone is comparison of clock times, with or without a stored offset.
An item indexed before capture times were kept has none until the next ``build-index`` reads it; until
then the time it was indexed stands in (in UTC). ``added_*`` compare the time indexed, an instant: a bound
without a zone is UTC.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from foundation.errors import ErrorKind, InvalidInputError

# When the photo was taken, or for items indexed before that was kept, when it was indexed.
TAKEN_OR_ADDED = "COALESCE(taken, added)"
LABELS_SHOWN = 30  # known labels an unknown-label error lists
_SURROGATES = (0xD800, 0xDFFF)


@dataclass(frozen=True)
class ItemFilter:
    """Every condition given must hold; ``labels``: any of them; times: ``added_from <= added < added_to``
    and ``taken_from <= taken < taken_to``."""

    labels: tuple[str, ...] = ()
    path_prefix: str | None = None  # relative to the gallery folder, e.g. "trips/2024/"
    added_from: dt.datetime | None = None
    added_to: dt.datetime | None = None
    taken_from: dt.datetime | None = None  # the camera's clock: no zone
    taken_to: dt.datetime | None = None

    def __post_init__(self) -> None:
        if self.path_prefix is not None:
            # Stored paths are relative with no "./" (as build-index writes them): "./camera/" is "camera/".
            prefix = self.path_prefix
            while prefix.startswith("./"):
                prefix = prefix[2:]
            if not prefix or prefix.startswith("/") or ".." in prefix.split("/"):
                given = self.path_prefix
                raise InvalidInputError(
                    f"path_prefix must be a non-empty path in the gallery folder, got {given!r}"
                )
            object.__setattr__(self, "path_prefix", prefix)
        for name in ("added_from", "added_to"):
            when = getattr(self, name)
            if when is not None:
                try:
                    _utc(when)
                except OverflowError:  # 0001-01-01T00:00:00+14:00 is before year 1 in UTC
                    raise InvalidInputError(
                        f"{name} {when.isoformat()} is out of range once converted to UTC"
                    ) from None
        for name in ("taken_from", "taken_to"):
            bound = getattr(self, name)
            if bound is not None and bound.tzinfo is not None:
                raise InvalidInputError(
                    f"{name} is a time on the camera's clock, compared with when each photo was taken "
                    f"there: give it without a zone, got {bound.isoformat()}"
                )

    def with_labels(self, labels: tuple[str, ...]) -> ItemFilter:
        return dataclasses.replace(self, labels=labels)

    @property
    def empty_range(self) -> bool:
        """Whether a time range holds no time (``added_from`` at or after ``added_to``, or ``taken_from``
        at or after ``taken_to``): it lets no item through, as SQL's would."""
        added = bool(self.added_from and self.added_to and _utc(self.added_from) >= _utc(self.added_to))
        return added or bool(self.taken_from and self.taken_to and self.taken_from >= self.taken_to)

    @property
    def empty(self) -> bool:
        times = (self.added_from, self.added_to, self.taken_from, self.taken_to)
        return not (self.labels or self.path_prefix or any(times))

    def sql(self) -> tuple[str, list[str]]:
        """A WHERE condition over the ``items`` table and its parameters (each part uses an index)."""
        parts: list[str] = []
        values: list[str] = []
        if self.labels:
            parts.append(f"label IN ({','.join('?' * len(self.labels))})")
            values.extend(self.labels)
        if self.path_prefix:
            # A range over the path index instead of LIKE, which would treat '_' and '%' as wildcards.
            parts.append("path >= ?")
            values.append(self.path_prefix)
            after = _after_prefix(self.path_prefix)
            if after is not None:
                parts.append("path < ?")
                values.append(after)
        if self.added_from:
            parts.append("added >= ?")
            values.append(stored_time(self.added_from))
        if self.added_to:
            parts.append("added < ?")
            values.append(stored_time(self.added_to))
        if self.taken_from:  # the expression of index.items' index items_by_taken
            parts.append(f"{TAKEN_OR_ADDED} >= ?")
            values.append(clock_time(self.taken_from))
        if self.taken_to:
            parts.append(f"{TAKEN_OR_ADDED} < ?")
            values.append(clock_time(self.taken_to))
        return " AND ".join(parts) or "1", values

    def milvus_expression(self, taken_field: str = "taken") -> str:
        """``taken_field``: the field ``taken_*`` compare (``added`` in collections made before ``taken``)."""
        parts = []
        if self.labels:
            parts.append(f"label in [{', '.join(json.dumps(label) for label in self.labels)}]")
        if self.path_prefix:
            parts.append(f"path >= {json.dumps(self.path_prefix)}")
            after = _after_prefix(self.path_prefix)
            if after is not None:
                parts.append(f"path < {json.dumps(after)}")
        if self.added_from:
            parts.append(f"added >= {json.dumps(stored_time(self.added_from))}")
        if self.added_to:
            parts.append(f"added < {json.dumps(stored_time(self.added_to))}")
        if self.taken_from:
            parts.append(f"{taken_field} >= {json.dumps(clock_time(self.taken_from))}")
        if self.taken_to:
            parts.append(f"{taken_field} < {json.dumps(clock_time(self.taken_to))}")
        return " and ".join(parts)


def _utc(time: dt.datetime) -> dt.datetime:
    """Times without a zone are taken as UTC, the zone items are stored in."""
    return time.replace(tzinfo=dt.UTC) if time.tzinfo is None else time.astimezone(dt.UTC)


def stored_time(time: dt.datetime) -> str:
    """The form ``added`` is stored in (``index.items.now_utc``), so that strings compare as times."""
    return _utc(time).isoformat(timespec="seconds")


class UnknownLabelError(InvalidInputError):
    """A label filter names a label no item has (ignoring case). Not found, as an unknown item id is: the
    labels change with every write, so no schema can list them."""

    kind = ErrorKind.NOT_FOUND
    code = "unknown_label"


def label_key(label: str) -> str:
    """What label filters compare: ``Hummer`` finds the folder ``hummer`` (and an NFD name its NFC form)."""
    return unicodedata.normalize("NFC", label).casefold()


def match_labels(wanted: Iterable[str], known: Iterable[str]) -> tuple[str, ...]:
    """The stored labels that ``wanted`` names, ignoring case, sorted; :class:`UnknownLabelError` naming
    the known labels when one of ``wanted`` matches none (a typo would otherwise just find nothing)."""
    by_key: dict[str, list[str]] = {}
    for label in known:
        by_key.setdefault(label_key(label), []).append(label)
    unknown = [label for label in wanted if label_key(label) not in by_key]
    if unknown:
        names = sorted({label for labels in by_key.values() for label in labels})
        shown = ", ".join(names[:LABELS_SHOWN]) + (
            f" and {len(names) - LABELS_SHOWN} more" if len(names) > LABELS_SHOWN else ""
        )
        raise UnknownLabelError(
            f"no item has the label {', '.join(map(repr, unknown))} (labels match whatever their case); "
            + (f"the labels are: {shown}" if names else "no item has a label")
        )
    return tuple(sorted({label for want in wanted for label in by_key[label_key(want)]}))


def clock_time(time: dt.datetime) -> str:
    """A clock-time bound in the form ``taken`` values start with."""
    return time.isoformat(timespec="seconds")


def _after_prefix(prefix: str) -> str | None:
    """The smallest string above every string that starts with ``prefix``; None when there is none (the
    prefix is all U+10FFFF, the last code point).

    Code-point order is SQLite's (UTF-8 bytes compare in code-point order), and the surrogates, which
    cannot be stored, are stepped over."""
    stem = prefix.rstrip(chr(sys.maxunicode))
    if not stem:
        return None
    following = ord(stem[-1]) + 1
    if _SURROGATES[0] <= following <= _SURROGATES[1]:
        following = _SURROGATES[1] + 1
    return stem[:-1] + chr(following)
