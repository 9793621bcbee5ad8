"""Which items a search may return: by label, by path prefix (a sub-folder) and by the time they were added.

One :class:`ItemFilter` is turned into an SQL condition for ``items.sqlite`` (the FAISS backend resolves it
to the set of allowed ids, then searches with a FAISS ``IDSelector``) or into a Milvus filter expression.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from dataclasses import dataclass

_SURROGATES = (0xD800, 0xDFFF)


@dataclass(frozen=True)
class ItemFilter:
    """Every condition given must hold; ``labels``: any of them; times: ``added_from <= added < added_to``."""

    labels: tuple[str, ...] = ()
    path_prefix: str | None = None  # relative to the gallery folder, e.g. "trips/2024/"
    added_from: dt.datetime | None = None
    added_to: dt.datetime | None = None

    def __post_init__(self) -> None:
        if self.path_prefix is not None:
            # Stored paths are relative with no "./" (as build-index writes them): "./camera/" is "camera/".
            prefix = self.path_prefix
            while prefix.startswith("./"):
                prefix = prefix[2:]
            if not prefix or prefix.startswith("/") or ".." in prefix.split("/"):
                given = self.path_prefix
                raise ValueError(f"path_prefix must be a non-empty path in the gallery folder, got {given!r}")
            object.__setattr__(self, "path_prefix", prefix)
        for name in ("added_from", "added_to"):
            when = getattr(self, name)
            if when is not None:
                try:
                    _utc(when)
                except OverflowError:  # 0001-01-01T00:00:00+14:00 is before year 1 in UTC
                    raise ValueError(
                        f"{name} {when.isoformat()} is out of range once converted to UTC"
                    ) from None

    @property
    def empty_range(self) -> bool:
        """Whether the time range holds no time (``added_from`` at or after ``added_to``): it lets no item
        through, as SQL's would."""
        return bool(self.added_from and self.added_to and _utc(self.added_from) >= _utc(self.added_to))

    @property
    def empty(self) -> bool:
        return not (self.labels or self.path_prefix or self.added_from or self.added_to)

    def sql(self) -> tuple[str, list[str]]:
        """A WHERE condition over the ``items`` table and its parameters (each part uses an index)."""
        parts, values = [], []
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
        return " AND ".join(parts) or "1", values

    def milvus_expression(self) -> str:
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
        return " and ".join(parts)


def _utc(time: dt.datetime) -> dt.datetime:
    """Times without a zone are taken as UTC, the zone items are stored in."""
    return time.replace(tzinfo=dt.UTC) if time.tzinfo is None else time.astimezone(dt.UTC)


def stored_time(time: dt.datetime) -> str:
    """The form ``added`` is stored in (``index.items.now_utc``), so that strings compare as times."""
    return _utc(time).isoformat(timespec="seconds")


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
