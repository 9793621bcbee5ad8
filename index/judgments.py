"""Judgments: a person's 👍 (+1) or 👎 (-1) on one result of one query, kept with the index.

A judgment names its query either as an item id or as an uploaded image (the image's content hash and its
embedding by the model that served it), the result's item id, the sign, when it was made (UTC) and that
model's fingerprint. Both backends keep them behind :class:`JudgmentStore`:

- FAISS: table ``judgments`` of ``items.sqlite`` (:class:`SqliteJudgments`); a trigger deletes the
  judgments naming an item in the same transaction that deletes the item.
- Milvus: a collection beside the items' (``<collection>_judgments``, :class:`MilvusJudgments`), so every
  replica serving that collection, and a training run reading it, sees every judgment; ``MilvusBackend``
  deletes the judgments naming the items it deletes, and reads leave out a judgment naming an item the
  items' collection no longer holds (one those deletes missed: ``MilvusJudgments._held``).

Judgments follow their items by id: a move keeps ids (so them), a rebuild copies them under the kept ids,
a merge under the ids the items' contents get (:func:`carry`). An uploaded query's embedding belongs to the
model that made it: a copy into an index of another model drops it (the uploaded image is not stored, so it
cannot be embedded again) and keeps the hash, the result, the sign and the fingerprint it was made under.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, Protocol

import numpy as np

from foundation.errors import InvalidInputError
from index.milvus_flush import DeferredFlushes
from index.milvus_tombstones import MilvusTombstones, id_list

SIGNS = (1, -1)
TABLE = "judgments"
_COLUMNS = "id, query_item, query_hash, query_vector, result, sign, time, model_fingerprint"


@dataclass(frozen=True)
class JudgedQuery:
    """What was searched: an item (``item``) or an uploaded image (``content_hash``, sha256 hex, and its
    ``embedding``: None once dropped for another model)."""

    item: int | None = None
    content_hash: str | None = None
    embedding: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if (self.item is None) == (self.content_hash is None):
            raise InvalidInputError("a judged query is an item id or an uploaded image's hash, not both")


@dataclass(frozen=True)
class Judgment:
    id: int
    query: JudgedQuery
    result: int  # the judged result's item id
    sign: int  # +1: this result is right for the query; -1: it is not
    time: str  # ISO 8601 in UTC
    model_fingerprint: str  # the model that served the result


def as_record(judgment: Judgment) -> dict[str, Any]:
    """A judgment as JSON's plain values (an uploaded query's embedding as a list of floats, or None)."""
    query = judgment.query
    return {
        "id": judgment.id,
        "query_item": query.item,
        "query_hash": query.content_hash,
        "result": judgment.result,
        "sign": judgment.sign,
        "time": judgment.time,
        "model_fingerprint": judgment.model_fingerprint,
        "query_embedding": None if query.embedding is None else [float(x) for x in query.embedding],
    }


def from_record(record: dict[str, Any]) -> Judgment:
    """The judgment :func:`as_record` gave."""
    embedding = record["query_embedding"]
    query = JudgedQuery(
        record["query_item"],
        record["query_hash"],
        None if embedding is None else np.asarray(embedding, np.float32),
    )
    fields = (record["result"], record["sign"], record["time"], record["model_fingerprint"])
    return Judgment(record["id"], query, *fields)


def check_sign(sign: int) -> None:
    if sign not in SIGNS:
        raise InvalidInputError(f"a judgment's sign is +1 or -1, not {sign}")


class JudgmentStore(Protocol):
    """The judgments of one index, by id (ids are never handed out again)."""

    def add(self, query: JudgedQuery, result: int, sign: int, model_fingerprint: str, time: str) -> Judgment:
        """Keep one judgment (the caller checks that its items exist); returns it with its new id."""
        ...

    def copy_in(self, judgments: Sequence[Judgment]) -> None:
        """Keep judgments of another index under their ids and times (replacing any of the same id)."""
        ...

    def get(self, judgment_id: int) -> Judgment | None: ...

    def remove(self, judgment_id: int) -> bool:
        """Delete one judgment; whether it existed."""
        ...

    def page(self, offset: int, limit: int) -> list[Judgment]:
        """Judgments in id order, ``limit`` of them after skipping ``offset``."""
        ...

    def scan(self) -> Iterator[Judgment]:
        """Every judgment, in id order."""
        ...

    def clear(self) -> int:
        """Delete every judgment; how many there were."""
        ...

    def __len__(self) -> int: ...


def carry(
    judgments: Iterable[Judgment], target: JudgmentStore, new_ids: Mapping[int, int], model_fingerprint: str
) -> int:
    """Copy ``judgments`` into ``target``, an index whose items are those of the judgments' index under
    ``new_ids`` (old item id -> new one); a judgment naming an item not there is left out, and an uploaded
    query's embedding is dropped where ``model_fingerprint`` (the target's model) is not the one that made
    it. Returns how many were copied."""
    kept = []
    for judgment in judgments:
        result, query = new_ids.get(judgment.result), judgment.query
        if result is None or (query.item is not None and query.item not in new_ids):
            continue
        if query.item is not None:
            query = JudgedQuery(item=new_ids[query.item])
        elif judgment.model_fingerprint != model_fingerprint:
            query = JudgedQuery(content_hash=query.content_hash)
        kept.append(replace(judgment, query=query, result=result))
    target.copy_in(kept)
    return len(kept)


class SqliteJudgments:
    """Table ``judgments`` of ``items.sqlite``, on the item store's connection."""

    def __init__(self, connection: sqlite3.Connection, dim: int, *, read_only: bool) -> None:
        self.connection = connection
        self.dim = dim
        if read_only:
            return
        with connection:
            # AUTOINCREMENT: a deleted judgment's id never names another one.
            connection.execute(
                f"CREATE TABLE IF NOT EXISTS {TABLE} (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                "query_item INTEGER, query_hash TEXT, query_vector BLOB, result INTEGER NOT NULL, "
                "sign INTEGER NOT NULL CHECK (sign IN (-1, 1)), time TEXT NOT NULL, "
                "model_fingerprint TEXT NOT NULL, CHECK ((query_item IS NULL) != (query_hash IS NULL)))"
            )
            connection.execute(f"CREATE INDEX IF NOT EXISTS judgments_by_result ON {TABLE} (result)")
            connection.execute(f"CREATE INDEX IF NOT EXISTS judgments_by_query ON {TABLE} (query_item)")
            # Judgments on a deleted item go with it, in the transaction that deletes it.
            connection.execute(
                "CREATE TRIGGER IF NOT EXISTS judgments_follow_items AFTER DELETE ON items BEGIN "
                f"DELETE FROM {TABLE} WHERE result = OLD.id OR query_item = OLD.id; END"
            )

    def add(self, query: JudgedQuery, result: int, sign: int, model_fingerprint: str, time: str) -> Judgment:
        check_sign(sign)
        with self.connection:
            cursor = self.connection.execute(
                f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES (NULL, ?, ?, ?, ?, ?, ?, ?)",
                self._values(query, result, sign, time, model_fingerprint),
            )
        assert cursor.lastrowid is not None  # the row id of the INSERT just run
        return Judgment(int(cursor.lastrowid), query, result, sign, time, model_fingerprint)

    def copy_in(self, judgments: Sequence[Judgment]) -> None:
        with self.connection:
            self.connection.executemany(
                f"INSERT OR REPLACE INTO {TABLE} ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (j.id, *self._values(j.query, j.result, j.sign, j.time, j.model_fingerprint))
                    for j in judgments
                ],
            )

    def _values(self, query: JudgedQuery, result: int, sign: int, time: str, fingerprint: str) -> tuple:
        vector = None if query.embedding is None else np.asarray(query.embedding, np.float32).tobytes()
        return query.item, query.content_hash, vector, int(result), int(sign), time, fingerprint

    def get(self, judgment_id: int) -> Judgment | None:
        if not self._exists():
            return None
        row = self.connection.execute(
            f"SELECT {_COLUMNS} FROM {TABLE} WHERE id = ?", (judgment_id,)
        ).fetchone()
        return self._judgment(row) if row else None

    def remove(self, judgment_id: int) -> bool:
        with self.connection:
            return self.connection.execute(f"DELETE FROM {TABLE} WHERE id = ?", (judgment_id,)).rowcount > 0

    def page(self, offset: int, limit: int) -> list[Judgment]:
        if not self._exists():
            return []
        rows = self.connection.execute(
            f"SELECT {_COLUMNS} FROM {TABLE} ORDER BY id LIMIT ? OFFSET ?", (limit, offset)
        )
        return [self._judgment(row) for row in rows]

    def scan(self) -> Iterator[Judgment]:
        if self._exists():
            for row in self.connection.execute(f"SELECT {_COLUMNS} FROM {TABLE} ORDER BY id"):
                yield self._judgment(row)

    def clear(self) -> int:
        with self.connection:
            return self.connection.execute(f"DELETE FROM {TABLE}").rowcount

    def __len__(self) -> int:
        if not self._exists():
            return 0
        return int(self.connection.execute(f"SELECT COUNT(*) FROM {TABLE}").fetchone()[0])

    def _exists(self) -> bool:
        """An index written before judgments were kept, opened read-only, has no table: no judgments."""
        query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
        return self.connection.execute(query, (TABLE,)).fetchone() is not None

    def _judgment(self, row: Sequence[Any]) -> Judgment:
        judgment_id, item, content_hash, vector, result, sign, time, fingerprint = row
        embedding = None if vector is None else np.frombuffer(vector, dtype=np.float32).copy()
        return Judgment(
            judgment_id, JudgedQuery(item, content_hash, embedding), result, sign, time, fingerprint
        )


# The Milvus collection's fields. A Milvus collection needs a vector field: the query's embedding, zeros
# where there is none (a query by item, or an embedding dropped), which ``has_embedding`` tells apart.
NO_ITEM = -1  # query_item of an uploaded query (older servers have no nullable fields)
_MILVUS_FIELDS = [
    "id",
    "query_item",
    "query_hash",
    "has_embedding",
    "result",
    "sign",
    "time",
    "model_fingerprint",
]
_FIELDS = [*_MILVUS_FIELDS, "query_vector"]  # a whole judgment
_PAGE = 1000


class MilvusJudgments:
    """The collection ``<items collection>_judgments`` beside the items' on the same Milvus.

    ``server`` is the backend's client (deadlines and errors as for items); ``new_ids`` hands out ids
    (``index.milvus_backend.IdClock``: every server version takes ids given by the client).
    """

    def __init__(
        self,
        server: Any,
        items_collection: str,
        dim: int,
        new_ids: Any,
        consistency: str,
        tombstones: MilvusTombstones,
        flushes: DeferredFlushes,
    ) -> None:
        self.server = server
        self.tombstones = tombstones  # deletes that outlast a restart of the server
        # Judgments arrive one request at a time, between saves: flushed soon after, so that a restarted
        # server reads them at once (index.milvus_flush).
        self.flushes = flushes
        self.items_collection = items_collection
        self.collection = f"{items_collection}_{TABLE}"
        self.dim = dim
        self.new_ids = new_ids
        self.consistency = consistency

    def create(self, data_type: Any) -> None:
        """Make the collection if it does not exist yet (``data_type``: pymilvus's ``DataType``)."""
        if self.server.has_collection(self.collection):
            return
        schema = self.server.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", data_type.INT64, is_primary=True)
        schema.add_field("query_vector", data_type.FLOAT_VECTOR, dim=self.dim)
        schema.add_field("query_item", data_type.INT64)
        schema.add_field("query_hash", data_type.VARCHAR, max_length=64)
        schema.add_field("has_embedding", data_type.BOOL)
        schema.add_field("result", data_type.INT64)
        schema.add_field("sign", data_type.INT64)
        schema.add_field("time", data_type.VARCHAR, max_length=40)
        schema.add_field("model_fingerprint", data_type.VARCHAR, max_length=64)
        index_params = self.server.prepare_index_params()  # never searched: the cheapest index
        index_params.add_index("query_vector", index_type="FLAT", metric_type="L2")
        self.server.create_collection(self.collection, schema=schema, index_params=index_params)

    def load(self) -> None:
        self.server.load_collection(self.collection)

    def add(self, query: JudgedQuery, result: int, sign: int, model_fingerprint: str, time: str) -> Judgment:
        check_sign(sign)
        judgment = Judgment(self.new_ids.take(1)[0], query, result, sign, time, model_fingerprint)
        self.copy_in([judgment])
        return judgment

    def copy_in(self, judgments: Sequence[Judgment]) -> None:
        for start in range(0, len(judgments), _PAGE):
            self.server.upsert(self.collection, [self._row(j) for j in judgments[start : start + _PAGE]])
        if judgments:
            self.flushes.written(self.collection)

    def _row(self, judgment: Judgment) -> dict[str, Any]:
        query = judgment.query
        embedding = query.embedding
        return {
            "id": int(judgment.id),
            "query_vector": np.zeros(self.dim, np.float32) if embedding is None else embedding,
            "query_item": NO_ITEM if query.item is None else int(query.item),
            "query_hash": query.content_hash or "",
            "has_embedding": embedding is not None,
            "result": int(judgment.result),
            "sign": int(judgment.sign),
            "time": judgment.time,
            "model_fingerprint": judgment.model_fingerprint,
        }

    def get(self, judgment_id: int) -> Judgment | None:
        rows = self._held(self._rows(f"id == {int(judgment_id)}", limit=1))
        return self._judgment(rows[0]) if rows else None

    def remove(self, judgment_id: int) -> bool:
        if self.get(judgment_id) is None:
            return False
        self._delete(f"id == {int(judgment_id)}")
        return True

    def forget_items(self, ids: Sequence[int]) -> None:
        """Delete the judgments naming any of ``ids`` (items being deleted) as query or result."""
        for start in range(0, len(ids), _PAGE):
            listed = ", ".join(str(int(i)) for i in ids[start : start + _PAGE])
            self._delete(f"result in [{listed}] or query_item in [{listed}]")

    def page(self, offset: int, limit: int) -> list[Judgment]:
        return list(islice(self.scan(), offset, offset + limit))

    def scan(self) -> Iterator[Judgment]:
        """Every judgment in id order, less those naming an item that is gone (:meth:`_held`)."""
        return (self._judgment(row) for row in self._scan(_FIELDS))

    def clear(self) -> int:
        count = len(self)
        self._delete("id >= 0")
        return count

    def __len__(self) -> int:
        """How many judgments :meth:`scan` reads (counted from their ids and items: the server's count
        would take in the ones naming an item that is gone)."""
        return sum(1 for _ in self._scan(["id", "query_item", "result"]))

    def _scan(self, fields: list[str]) -> Iterator[dict]:
        """Pages of rows above the last id seen (Milvus returns a limited query's smallest ids)."""
        last = -1
        while rows := self._rows(f"id > {last}", limit=_PAGE, fields=fields):
            yield from self._held(rows)
            last = int(rows[-1]["id"])

    def _held(self, rows: list[dict]) -> list[dict]:
        """``rows`` less the judgments naming an item (query or result) the items' collection does not hold.

        Such a judgment is one the deletion of its item missed: in the ~30 s after a restart of the server
        a removal finds the judgments naming its items at the ``Session`` level (:meth:`_delete`), which
        can miss one another replica made moments before; and a judgment added while its item is being
        removed elsewhere can land after the removal looked. Left stored, it is not listed, exported or
        trained on as if its item were still there, and a rebuild does not copy it (:func:`carry`)."""
        named = sorted({int(row[key]) for row in rows for key in ("result", "query_item")} - {NO_ITEM})
        held: set[int] = set()
        for start in range(0, len(named), _PAGE):
            chunk = named[start : start + _PAGE]
            found = self.server.query(
                self.items_collection,
                filter=id_list(chunk),
                output_fields=["id"],
                limit=len(chunk),
                consistency_level=self.consistency,
            )
            held.update(int(row["id"]) for row in found)
        return [row for row in rows if {int(row["result"]), int(row["query_item"])} - {NO_ITEM} <= held]

    def _delete(self, condition: str) -> None:
        """Delete the judgments that meet ``condition``, by their ids, recorded first (``tombstones``).

        Found at the ``Strong`` level (another replica's latest judgments too), except while a re-deletion
        is due after a reconnection (``MilvusTombstones.covering``): a restarted server answers ``Strong``
        reads only ~25-30 s after it answers at all, so then at the ``Session`` level, which misses
        judgments another replica made in the moments before."""
        covering = self.tombstones.covering()
        ids: list[int] = []
        while rows := self.server.query(
            self.collection,
            filter=f"({condition}) and id > {ids[-1] if ids else -1}",
            output_fields=["id"],
            limit=_PAGE,
            consistency_level=self.consistency if covering else "Strong",
        ):
            ids += sorted(int(row["id"]) for row in rows)
        if not ids:
            return
        self.tombstones.record(self.collection, ids)
        for start in range(0, len(ids), _PAGE):
            self.server.delete(self.collection, filter=id_list(ids[start : start + _PAGE]))
        if not self.tombstones.covering():  # else reads leave them out until the re-deletion is applied
            # A delete does not move the session's timestamp: one Strong read waits until it is applied.
            self.server.query(
                self.collection, filter="id < 0", output_fields=["id"], consistency_level="Strong"
            )

    def _rows(self, condition: str, *, limit: int, fields: list[str] = _FIELDS) -> list[dict]:
        """The rows that meet ``condition`` (their ``fields``), in id order."""
        rows = self.server.query(
            self.collection,
            filter=condition,
            output_fields=fields,
            limit=limit,
            consistency_level=self.consistency,
        )
        return sorted(rows, key=lambda row: int(row["id"]))

    @staticmethod
    def _judgment(row: dict) -> Judgment:
        item = int(row["query_item"])
        embedding = np.asarray(row["query_vector"], np.float32) if row["has_embedding"] else None
        query = (
            JudgedQuery(item=item)
            if item != NO_ITEM
            else JudgedQuery(content_hash=row["query_hash"], embedding=embedding)
        )
        return Judgment(
            int(row["id"]), query, int(row["result"]), int(row["sign"]), row["time"], row["model_fingerprint"]
        )
