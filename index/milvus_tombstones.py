"""Deletes that outlast a restart of the Milvus server: the collection ``<items collection>_removed`` records,
as inserts, the ids every delete removes (items, judgments), and each new connection to the server has them
deleted again, in the background, while reads leave them out.

Why: the real Milvus 2.3.5 standalone server, killed and started again on its data folder, brought back rows
deleted (and flushed) before the kill, while it kept every inserted row (bench/operator_walkthrough.py,
issue 42; upstream, milvus-io/milvus#33015, "many of the delete issues" fixed in 2.3.15). A delete of an id
that is gone changes nothing, and ids are never handed out twice (``IdClock``, or the server's own), so
deleting them all again after every reconnection is safe.

Why in the background: after such a restart the server answers reads of the ``Eventually`` level at once,
but ``Strong`` and ``Bounded`` ones only about 25 s later (its time ticks resume late), where a request has
10 s. So, at a new connection, the first call reads the recorded ids at the ``Eventually`` level (about
0.1 s) and from then on every read leaves them out (``exclusion``); a thread of its own, on a connection of
its own, reads them again at the ``Strong`` level (another replica's latest too), deletes them again and
waits with one ``Strong`` read per collection until the server has applied the deletes; only then do reads
stop leaving them out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from index.milvus_flush import DeferredFlushes
from index.protocol import BackendUnavailableError

SUFFIX = "removed"
PAGE = 1000  # ids a query returns or a delete names at once
_OF_BYTES = 255  # the longest collection name Milvus allows
RETRY_S = 2.0  # between tries of the background re-deletion while the server does not answer

log = logging.getLogger(__name__)


class NotListedError(BackendUnavailableError):
    """The server answers but does not list the index's collections (yet): under load, a restarted Milvus
    2.3.5 was seen answering before it listed the collections it held."""


def id_list(ids: Sequence[int]) -> str:
    """``id in [...]`` as a Milvus 2.3 expression (a literal list: 2.3 has no templates)."""
    return f"id in [{', '.join(str(int(i)) for i in ids)}]"


class MilvusTombstones:
    """The removed ids of an items collection and of its judgments, on the same server.

    ``server`` is the backend's client (``index.milvus_backend._Server``: deadlines and errors as for
    items); ``background`` opens another one, on a connection of its own, for the re-deletion (a call of it
    that times out closes its own connection, not the one requests share)."""

    def __init__(
        self, server: Any, items_collection: str, background: Callable[[], Any], flushes: DeferredFlushes
    ) -> None:
        self.server = server
        self.flushes = flushes  # records flushed soon: a restarted server shows unflushed ones only late
        self.items_collection = items_collection
        self.collection = f"{items_collection}_{SUFFIX}"
        self._open_background = background
        self._known: dict[str, set[int]] = {}  # recorded ids by the collection they left
        self._lock = threading.Lock()
        # Passes of the re-deletion asked for (one at each new connection: ``reconnected``; one more at each
        # record made while one is due) and the last the server has applied.
        self._wanted = 0
        self._confirmed = 0
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        # Whether the index's collections must exist (a built index opened, or :meth:`create` ran): the server
        # not listing them then is a server not ready yet (:class:`NotListedError`), not "nothing recorded".
        self.expected = False

    def create(self, data_type: Any) -> None:
        """Make the collection if it does not exist yet (``data_type``: pymilvus's ``DataType``)."""
        self.expected = True
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
        self._remember(of, ids)
        for start in range(0, len(ids), PAGE):
            rows = [{"removed": int(i), "of": of, "vector": [0.0, 0.0]} for i in ids[start : start + PAGE]]
            self.server.insert(self.collection, rows)
        self.flushes.written(self.collection)
        with self._lock:
            if self._confirmed != self._wanted:  # a pass now under way may have read the records before these
                self._wanted += 1
                self._wake.notify_all()

    def covering(self) -> bool:
        """Whether reads leave the recorded ids out now (a re-deletion is due): a removal need not wait
        with a ``Strong`` read (which a restarted server answers only ~25-30 s after it answers at all) for
        the server to apply its delete before this process reads again."""
        with self._lock:
            return self._confirmed != self._wanted

    def exclusion(self, collection: str) -> str | None:
        """An expression that keeps the recorded ids of ``collection`` out of a read, while the server may
        not have applied their re-deletion since the last new connection; None once it has."""
        with self._lock:
            if self._confirmed == self._wanted or not self._known.get(collection):
                return None
            return f"id not in [{', '.join(str(i) for i in sorted(self._known[collection]))}]"

    def reconnected(self) -> None:
        """Run by the first call on a new connection, before it answers: read the recorded ids as the
        server has them now, leave them out of reads, and have them deleted again in the background."""
        with self._lock:
            self._wanted += 1
            connection = self._wanted
        self._remember_all(self._read(self.server, "Eventually"))
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._redelete_forever, name="milvus-redelete", daemon=True
                )
                self._thread.start()
            self._wake.notify_all()
        log.debug("connection %d to Milvus: removed ids are being deleted again", connection)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    def _remember(self, of: str, ids: Sequence[int]) -> None:
        with self._lock:
            self._known.setdefault(of, set()).update(int(i) for i in ids)

    def _remember_all(self, removed: dict[str, list[int]]) -> None:
        for of, ids in removed.items():
            self._remember(of, ids)

    def _read(self, server: Any, consistency: str) -> dict[str, list[int]]:
        """The recorded ids by collection, read at the ``consistency`` level."""
        removed: dict[str, list[int]] = {}
        if not server.has_collection(self.collection):
            if self.expected and not server.has_collection(self.items_collection):
                raise NotListedError(
                    f"Milvus at {server.where} does not list the collections of this index "
                    f"({self.items_collection!r}, {self.collection!r}) at the moment: the ids removed from "
                    "it cannot be read (a server just started lists them within seconds)"
                )
            return removed  # an index from before it, or one being made: nothing recorded
        # Read only from loaded collections: Milvus Lite opens its file with every collection released.
        server.load_collection(self.collection)
        last = -1
        while rows := server.query(
            self.collection,
            filter=f"id > {last}",
            output_fields=["id", "removed", "of"],
            limit=PAGE,
            consistency_level=consistency,
        ):
            for row in rows:
                removed.setdefault(row["of"], []).append(int(row["removed"]))
            last = max(int(row["id"]) for row in rows)
        return removed

    def _redelete_forever(self) -> None:
        """The background thread: after each new connection, delete every recorded id again, until the
        server has applied it (tried again every ``RETRY_S`` while it fails)."""
        server = None
        while True:
            with self._lock:
                while not self._closed and self._confirmed == self._wanted:
                    self._wake.wait()
                if self._closed:
                    break
                connection = self._wanted
            try:
                server = server or self._open_background()
                self._redelete(server)
            except BackendUnavailableError as err:
                log.info("removed ids not deleted again yet, tried again in %g s: %s", RETRY_S, err)
                with self._lock:
                    self._wake.wait(RETRY_S)
                continue
            with self._lock:
                self._confirmed = max(self._confirmed, connection)
        if server is not None:
            server.close()

    def _redelete(self, server: Any) -> None:
        removed = self._read(server, "Strong")  # another replica's latest records too
        self._remember_all(removed)
        for of, ids in removed.items():
            if not server.has_collection(of):
                continue  # dropped since
            server.load_collection(of)
            for start in range(0, len(ids), PAGE):
                server.delete(of, filter=id_list(ids[start : start + PAGE]))
            # A delete does not move the session's timestamp: one Strong read waits until it is applied.
            server.query(of, filter="id < 0", output_fields=["id"], consistency_level="Strong")
