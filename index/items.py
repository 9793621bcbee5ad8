"""``items.sqlite``: per-item metadata and the raw vector of every item, beside a FAISS index.

The stored vectors are the source of truth the FAISS file is derived from: a build that is interrupted
resumes from them, an index is re-trained or changes type without re-embedding any image, an HNSW graph
is rebuilt from them once removed items pile up in it, and shard directories merge from them.

A path that is not UTF-8 (a Latin-1 file name) is stored as the name's bytes (a BLOB in the path column)
and read back with Python's surrogate escapes: the same name opens the same file.

Items also carry when their photo was taken (column ``taken``, see ``index.filters``): indexes written before
it gain the column when next opened for writing, and their items have none until a build reads it.

The index's judgments (👍/👎 on results, ``index.judgments``) are a table of this file too.

Items may also carry a perceptual signature (opaque bytes the engine computes from the image, see
``engine.duplicates.groups``), in a table of its own: indexes written before it existed gain the empty table
when next opened for writing, and their items simply have none.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from foundation.errors import NotFoundError
from foundation.regular_files import require_regular
from index.filters import TAKEN_OR_ADDED, ItemFilter
from index.judgments import SqliteJudgments
from index.protocol import Entry, Item, Move, check_dim, normalize_rows, not_unit_rows

_COLUMNS = "id, path, label, content_hash, added, taken"
_COLUMNS_BEFORE_TAKEN = "id, path, label, content_hash, added, NULL"  # an old store, opened read-only
_SQL_CHUNK = 10_000  # ids per "IN (...)" query, below SQLite's variable limit


def _stored(path: str) -> str | bytes:
    """A gallery-relative path as the store keeps it: text, or the name's bytes when it is not UTF-8
    (a Latin-1 name from an old zip file, which Python holds with surrogate escapes): SQLite takes text
    only as UTF-8, and the bytes are what opens the file again."""
    try:
        path.encode()
    except UnicodeEncodeError:
        return os.fsencode(path)
    return path


def _item(row: Sequence[Any]) -> Item:
    """An item from its row, its path back in Python's form for file names (see :func:`_stored`)."""
    path = row[1]
    return Item(row[0], os.fsdecode(path) if isinstance(path, bytes) else path, *row[2:])


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class ItemStore:
    FILE_NAME = "items.sqlite"

    def __init__(self, directory: Path, dim: int, *, read_only: bool = False) -> None:
        """``read_only``: open an existing store without the right to change it (reading another index)."""
        self.dim = dim
        path = directory / self.FILE_NAME
        if read_only and not path.exists():
            raise NotFoundError(f"{directory} has no {self.FILE_NAME}")
        if path.exists() or path.is_symlink():
            require_regular(path)  # SQLite would wait on a FIFO for ever
        if read_only:
            self.connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
            self._columns = _COLUMNS if self._has_taken() else _COLUMNS_BEFORE_TAKEN
            self.judgments = SqliteJudgments(self.connection, dim, read_only=True)
            return
        self._columns = _COLUMNS
        self.connection = sqlite3.connect(path, check_same_thread=False)
        with self.connection:
            # AUTOINCREMENT: an id is never handed out again, even after its item is removed.
            self.connection.execute(
                "CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                "path TEXT NOT NULL UNIQUE, label TEXT, content_hash TEXT NOT NULL, added TEXT NOT NULL, "
                "taken TEXT)"
            )
            if not self._has_taken():  # a store from before capture times were kept
                self.connection.execute("ALTER TABLE items ADD COLUMN taken TEXT")
            self.connection.execute("CREATE INDEX IF NOT EXISTS items_by_hash ON items (content_hash)")
            # Filtered search (index.filters) resolves labels and time ranges through these.
            self.connection.execute("CREATE INDEX IF NOT EXISTS items_by_label ON items (label)")
            self.connection.execute("CREATE INDEX IF NOT EXISTS items_by_added ON items (added)")
            self.connection.execute(f"CREATE INDEX IF NOT EXISTS items_by_taken ON items ({TAKEN_OR_ADDED})")
            self.connection.execute(
                "CREATE TABLE IF NOT EXISTS vectors (id INTEGER PRIMARY KEY, vector BLOB NOT NULL)"
            )
            self.connection.execute(
                "CREATE TABLE IF NOT EXISTS signatures (id INTEGER PRIMARY KEY, signature BLOB NOT NULL)"
            )
        self.judgments = SqliteJudgments(self.connection, dim, read_only=False)  # kept with the items

    # -- writing -----------------------------------------------------------------------------------

    def add(
        self,
        vectors: np.ndarray,
        entries: Sequence[Entry],
        *,
        added: Sequence[str] | None = None,
        ids: Sequence[int] | None = None,
        signatures: Sequence[bytes | None] | None = None,
    ) -> list[int]:
        """Insert items, their vectors and signatures in one transaction; return their new ids.

        ``added`` and ``ids``: the items' original times and ids (when copying items between indexes);
        default now and the next free ids. ``signatures``: each item's perceptual signature (None: none).
        """
        vectors = normalize_rows(vectors)
        check_dim(vectors, self.dim)
        if len(vectors) != len(entries):
            raise ValueError(f"{len(vectors)} vectors but {len(entries)} metadata rows")
        times = added if added is not None else [now_utc()] * len(entries)
        given = ids if ids is not None else [None] * len(entries)  # None: SQLite picks the next id
        marks = signatures if signatures is not None else [None] * len(entries)
        new_ids = []
        with self.connection:
            cursor = self.connection.cursor()
            rows = zip(vectors, entries, times, given, marks, strict=True)
            for vector, entry, time, item_id, signature in rows:
                cursor.execute(
                    f"INSERT INTO items ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                    (item_id, _stored(entry.path), entry.label, entry.content_hash, time, entry.taken),
                )
                assert cursor.lastrowid is not None  # the row id of the INSERT just run
                new_ids.append(int(cursor.lastrowid))
                cursor.execute(
                    "INSERT INTO vectors (id, vector) VALUES (?, ?)", (new_ids[-1], vector.tobytes())
                )
                if signature is not None:
                    cursor.execute(
                        "INSERT INTO signatures (id, signature) VALUES (?, ?)", (new_ids[-1], signature)
                    )
        return new_ids

    def last_id(self) -> int:
        """The highest id ever handed out, removed items' included: new items get higher ones."""
        row = self.connection.execute("SELECT seq FROM sqlite_sequence WHERE name = 'items'").fetchone()
        return int(row[0]) if row else 0

    def reserve_ids(self, last_id: int) -> None:
        """Hand out new ids above ``last_id``: those of the store these items were copied from, so that an
        id it gave a removed item never names another one."""
        with self.connection:
            updated = self.connection.execute(
                "UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'items'", (last_id,)
            ).rowcount
            if not updated:
                self.connection.execute(
                    "INSERT INTO sqlite_sequence (name, seq) VALUES ('items', ?)", (last_id,)
                )

    def remove(self, ids: Sequence[int]) -> int:
        rows = [(int(i),) for i in ids]
        with self.connection:
            removed = self.connection.executemany("DELETE FROM items WHERE id = ?", rows).rowcount
            self.connection.executemany("DELETE FROM vectors WHERE id = ?", rows)
            self.connection.executemany("DELETE FROM signatures WHERE id = ?", rows)
        return removed

    def move(self, moves: Sequence[Move]) -> int:
        with self.connection:
            return self.connection.executemany(
                "UPDATE items SET path = ?, label = ? WHERE id = ?",
                [(_stored(move.path), move.label, int(move.id)) for move in moves],
            ).rowcount

    def set_taken(self, taken: Mapping[int, str]) -> int:
        with self.connection:
            return self.connection.executemany(
                "UPDATE items SET taken = ? WHERE id = ?", [(time, int(i)) for i, time in taken.items()]
            ).rowcount

    # -- metadata ----------------------------------------------------------------------------------

    def get_many(self, ids: Sequence[int]) -> dict[int, Item]:
        found: dict[int, Item] = {}
        for start in range(0, len(ids), _SQL_CHUNK):
            chunk = [int(i) for i in ids[start : start + _SQL_CHUNK]]
            placeholders = ",".join("?" * len(chunk))
            rows = self.connection.execute(
                f"SELECT {self._columns} FROM items WHERE id IN ({placeholders})", chunk
            ).fetchall()
            found.update((row[0], _item(row)) for row in rows)
        return found

    def get(self, item_id: int) -> Item | None:
        return self.get_many([item_id]).get(item_id)

    def get_by_path(self, path: str) -> Item | None:
        row = self.connection.execute(
            f"SELECT {self._columns} FROM items WHERE path = ?", (_stored(path),)
        ).fetchone()
        return _item(row) if row else None

    def get_by_content(self, content_hash: str) -> Item | None:
        """The item (the first, by id) whose file has the content ``content_hash``, or None."""
        row = self.connection.execute(
            f"SELECT {self._columns} FROM items WHERE content_hash = ? ORDER BY id LIMIT 1", (content_hash,)
        ).fetchone()
        return _item(row) if row else None

    def matching_ids(self, where: ItemFilter) -> np.ndarray:
        """The ids of the items ``where`` lets through, ascending."""
        condition, values = where.sql()
        rows = self.connection.execute(
            f"SELECT id FROM items WHERE {condition} ORDER BY id", values
        ).fetchall()
        return np.array([row[0] for row in rows], dtype=np.int64)

    def page(self, offset: int, limit: int) -> list[Item]:
        rows = self.connection.execute(
            f"SELECT {self._columns} FROM items ORDER BY id LIMIT ? OFFSET ?", (limit, offset)
        ).fetchall()
        return [_item(row) for row in rows]

    def scan(self) -> Iterator[Item]:
        for row in self.connection.execute(f"SELECT {self._columns} FROM items ORDER BY id"):
            yield _item(row)

    def label_counts(self) -> dict[str, int]:
        rows = self.connection.execute(
            "SELECT label, COUNT(*) FROM items WHERE label IS NOT NULL GROUP BY label ORDER BY label"
        )
        return dict(rows.fetchall())

    def __len__(self) -> int:
        return int(self.connection.execute("SELECT COUNT(*) FROM items").fetchone()[0])

    # -- vectors (a VectorSource for building FAISS indexes) -------------------------------------------

    def ids(self) -> np.ndarray:
        rows = self.connection.execute("SELECT id FROM vectors ORDER BY id").fetchall()
        return np.array([row[0] for row in rows], dtype=np.int64)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """The stored vectors of ``ids``, in that order."""
        by_id: dict[int, bytes] = {}
        for start in range(0, len(ids), _SQL_CHUNK):
            chunk = [int(i) for i in ids[start : start + _SQL_CHUNK]]
            placeholders = ",".join("?" * len(chunk))
            by_id.update(
                self.connection.execute(f"SELECT id, vector FROM vectors WHERE id IN ({placeholders})", chunk)
            )
        missing = [int(i) for i in ids if int(i) not in by_id]
        if missing:
            raise KeyError(f"no stored vector for ids {missing[:5]}")
        return self._decode([by_id[int(i)] for i in ids])

    def iter_vectors(
        self, chunk_size: int, ids: np.ndarray | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(ids, vectors)`` chunks in id order: every stored vector, or those of ``ids``."""
        if ids is not None:
            for start in range(0, len(ids), chunk_size):
                chunk = np.asarray(ids[start : start + chunk_size], dtype=np.int64)
                yield chunk, self.vectors(chunk)
            return
        cursor = self.connection.execute("SELECT id, vector FROM vectors ORDER BY id")
        while rows := cursor.fetchmany(chunk_size):
            yield np.array([row[0] for row in rows], dtype=np.int64), self._decode([row[1] for row in rows])

    def vector_problem(self, chunk_size: int = _SQL_CHUNK) -> str | None:
        """What is wrong with the stored vectors, or None: every item has one vector of ``dim`` float32s,
        finite and of unit length (or zero: ``add`` stores them normalised), and none without an item."""
        size = self.dim * np.dtype(np.float32).itemsize
        (wrong_size,) = self.connection.execute(
            "SELECT COUNT(*) FROM vectors WHERE typeof(vector) != 'blob' OR length(vector) != ?", (size,)
        ).fetchone()
        if wrong_size:
            return f"{wrong_size} stored vectors are not {self.dim} float32s (corrupt vector blobs)"
        (unpaired,) = self.connection.execute(
            "SELECT (SELECT COUNT(*) FROM items WHERE id NOT IN (SELECT id FROM vectors))"
            " + (SELECT COUNT(*) FROM vectors WHERE id NOT IN (SELECT id FROM items))"
        ).fetchone()
        if unpaired:
            return f"{unpaired} items have no stored vector or vectors no item"
        for ids, vectors in self.iter_vectors(chunk_size):
            bad = not_unit_rows(vectors)
            if bad.any():
                some = ids[bad][:5].tolist()
                return f"stored vectors of ids {some} are not finite unit vectors (corrupt blobs)"
        return None

    # -- perceptual signatures ---------------------------------------------------------------------

    def signatures(self, ids: Sequence[int] | None = None) -> dict[int, bytes]:
        """The stored signatures of those of ``ids`` (default: of every item) that have one."""
        if not self._has_signatures():  # an index from before signatures, opened read-only
            return {}
        if ids is None:
            return dict(self.connection.execute("SELECT id, signature FROM signatures"))
        found: dict[int, bytes] = {}
        for start in range(0, len(ids), _SQL_CHUNK):
            chunk = [int(i) for i in ids[start : start + _SQL_CHUNK]]
            placeholders = ",".join("?" * len(chunk))
            found.update(
                self.connection.execute(
                    f"SELECT id, signature FROM signatures WHERE id IN ({placeholders})", chunk
                )
            )
        return found

    def _has_taken(self) -> bool:
        return any(row[1] == "taken" for row in self.connection.execute("PRAGMA table_info(items)"))

    def _has_signatures(self) -> bool:
        query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'signatures'"
        return self.connection.execute(query).fetchone() is not None

    def _decode(self, blobs: list[bytes]) -> np.ndarray:
        if not blobs:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), self.dim).copy()

    def close(self) -> None:
        self.connection.close()
