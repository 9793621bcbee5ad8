"""Per-item metadata (id, relative path, label, content hash, time added) in SQLite."""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Item:
    id: int
    path: str
    label: str | None
    content_hash: str
    added: str


class ItemStore:
    FILE_NAME = "items.sqlite"

    def __init__(self, directory: Path) -> None:
        self.connection = sqlite3.connect(directory / self.FILE_NAME, check_same_thread=False)
        self.connection.execute(
            "CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE, "
            "label TEXT, content_hash TEXT NOT NULL, added TEXT NOT NULL)"
        )
        self.connection.commit()

    def add(self, items: Iterable[tuple[str, str | None, str]]) -> list[int]:
        """Insert ``(path, label, content_hash)`` rows in one transaction; return their new ids."""
        added = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self.connection:
            cursor = self.connection.cursor()
            ids = []
            for path, label, content_hash in items:
                cursor.execute(
                    "INSERT INTO items (path, label, content_hash, added) VALUES (?, ?, ?, ?)",
                    (path, label, content_hash, added),
                )
                ids.append(int(cursor.lastrowid))
        return ids

    def get_many(self, ids: Sequence[int]) -> dict[int, Item]:
        if not ids:
            return {}
        placeholders = ",".join("?" * len(ids))
        rows = self.connection.execute(
            f"SELECT id, path, label, content_hash, added FROM items WHERE id IN ({placeholders})",
            [int(i) for i in ids],
        ).fetchall()
        return {row[0]: Item(*row) for row in rows}

    def get(self, item_id: int) -> Item | None:
        return self.get_many([item_id]).get(item_id)

    def remove(self, ids: Sequence[int]) -> None:
        with self.connection:
            self.connection.executemany("DELETE FROM items WHERE id = ?", [(int(i),) for i in ids])

    def __len__(self) -> int:
        return int(self.connection.execute("SELECT COUNT(*) FROM items").fetchone()[0])

    def close(self) -> None:
        self.connection.close()
