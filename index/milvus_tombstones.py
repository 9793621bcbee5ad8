"""Deletes that outlast a restart of the Milvus server: the collection ``<items collection>_removed`` records,
as inserts, the ids every delete removes (items, judgments), and each new connection to the server deletes
the recorded ids again before it answers.

Why: the real Milvus 2.3.5 standalone server, killed and started again on its data folder, brought back rows
deleted (and flushed) before the kill, while it kept every inserted row (bench/operator_walkthrough.py,
issue 42; upstream, milvus-io/milvus#33015, "many of the delete issues" fixed in 2.3.15). A delete of an id
that is gone changes nothing, and ids are never handed out twice (``IdClock``, or the server's own), so
deleting them all again after every reconnection is safe.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

SUFFIX = "removed"
PAGE = 1000  # ids a query returns or a delete names at once
_OF_BYTES = 255  # the longest collection name Milvus allows


def id_list(ids: Sequence[int]) -> str:
    """``id in [...]`` as a Milvus 2.3 expression (a literal list: 2.3 has no templates)."""
    return f"id in [{', '.join(str(int(i)) for i in ids)}]"


class MilvusTombstones:
    """The removed ids of an items collection and of its judgments, on the same server.

    ``server`` is the backend's client (``index.milvus_backend._Server``: deadlines and errors as for
    items)."""

    def __init__(self, server: Any, items_collection: str) -> None:
        self.server = server
        self.collection = f"{items_collection}_{SUFFIX}"

    def create(self, data_type: Any) -> None:
        """Make the collection if it does not exist yet (``data_type``: pymilvus's ``DataType``)."""
        if self.server.has_collection(self.collection):
            return
        schema = self.server.create_schema(auto_id=True, enable_dynamic_field=False)
        schema.add_field("id", data_type.INT64, is_primary=True)
        schema.add_field("removed", data_type.INT64)  # the id removed
        schema.add_field("of", data_type.VARCHAR, max_length=_OF_BYTES)  # from which collection
        schema.add_field("vector", data_type.FLOAT_VECTOR, dim=2)  # Milvus 2.3 requires one; never searched
        index_params = self.server.prepare_index_params()
        index_params.add_index("vector", index_type="FLAT", metric_type="L2")
        self.server.create_collection(self.collection, schema=schema, index_params=index_params)
        self.server.load_collection(self.collection)

    def record(self, of: str, ids: Sequence[int]) -> None:
        """Record that ``ids`` are being removed from the collection ``of`` (before removing them)."""
        for start in range(0, len(ids), PAGE):
            rows = [{"removed": int(i), "of": of, "vector": [0.0, 0.0]} for i in ids[start : start + PAGE]]
            self.server.insert(self.collection, rows)

    def reapply(self) -> int:
        """Delete every recorded id from its collection again; how many ids are recorded."""
        if not self.server.has_collection(self.collection):
            return 0  # an index from before it, or a collection just being made: nothing recorded
        # Read only from loaded collections: Milvus Lite opens its file with every collection released.
        self.server.load_collection(self.collection)
        removed: dict[str, list[int]] = defaultdict(list)
        last = -1
        while rows := self.server.query(
            self.collection,
            filter=f"id > {last}",
            output_fields=["id", "removed", "of"],
            limit=PAGE,
            consistency_level="Strong",
        ):
            for row in rows:
                removed[row["of"]].append(int(row["removed"]))
            last = max(int(row["id"]) for row in rows)
        for of, ids in removed.items():
            if not self.server.has_collection(of):
                continue  # dropped since
            self.server.load_collection(of)
            for start in range(0, len(ids), PAGE):
                self.server.delete(of, filter=id_list(ids[start : start + PAGE]))
            # A delete does not move the session's timestamp: one Strong read waits until it is applied.
            self.server.query(of, filter="id < 0", output_fields=["id"], consistency_level="Strong")
        return sum(len(ids) for ids in removed.values())
