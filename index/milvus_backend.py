"""The Milvus backend: one collection holds the vectors and the item metadata as fields.

``uri`` is a Milvus standalone or cluster address (``http://host:19530``) or a local file path, which
runs Milvus Lite in-process (what the tests use: a real engine). Ids are allocated by Milvus
(``auto_id``), so several machines building shards of one gallery can write into one collection
without coordinating. The collection records the model fingerprint, so vectors of two models never mix.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from index.filters import ItemFilter
from index.items import now_utc
from index.manifest import MILVUS_COLLECTION, Manifest
from index.protocol import Entry, Item, Move, check_dim, normalize_rows
from index.selection import IndexOptions

MODEL_PROPERTY = "dmlsearch.model_fingerprint"
METADATA_FIELDS = ["path", "label", "content_hash", "added"]
TAKEN = "taken"  # a field of collections made since capture times were kept (index.filters)
MAX_PATH = 4096
MAX_LABEL = 512
PAGE = 1000
MAX_TOP_K = 16_384  # Milvus's limit on k
# Milvus index and search parameters per requested index type ("auto" lets Milvus choose; in Milvus Lite
# it builds a graph index on sealed segments, whose search beam "ef" must be at least k).
MILVUS_INDEXES: dict[str, tuple[str, dict[str, int], dict[str, int]]] = {
    "auto": ("AUTOINDEX", {}, {"ef": 64}),
    "flat": ("FLAT", {}, {}),
    "hnsw": ("HNSW", {"M": 32, "efConstruction": 200}, {"ef": 128}),
    "ivf": ("IVF_FLAT", {"nlist": 1024}, {"nprobe": 32}),
    "ivfsq": ("IVF_SQ8", {"nlist": 1024}, {"nprobe": 32}),
    "ivfpq": ("IVF_PQ", {"nlist": 1024, "m": 64, "nbits": 8}, {"nprobe": 32}),
}
DEFAULT_LITE_FILE = "milvus.db"
# A filtered graph search walks past the items the filter drops: with a 5% label filter over 3,000 items
# (tests/index/test_filtered_search.py), Milvus Lite's graph at ef 64 returned 9 of 10 results for some
# queries once it had indexed the collection, 10 from ef 128.
FILTERED_EF_FACTOR = 4


def _pymilvus():
    try:
        import pymilvus
    except ImportError as err:
        raise ImportError("pymilvus is not installed: pip install 'dmlsearch[milvus]'") from err
    return pymilvus


class _LiteIteratorTimestamp(logging.Filter):
    """Drops pymilvus's "failed to get mvccTs from milvus server, use client-side ts instead".

    Milvus Lite implements no server-side timestamps (its AllocTimestamp answers "not implemented"), so
    every ``query_iterator`` (``scan``: each build-index and duplicates run) logged it, though the
    client-side timestamp pymilvus then takes is the right one for a local file read in this process.
    Installed only when a Milvus Lite file is opened: from a server the warning means something.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed to get mvccTs")


_LITE_ITERATOR_FILTER = _LiteIteratorTimestamp()


def resolve_uri(uri: str, directory: Path) -> str:
    """Remote URIs as they are; a Milvus Lite file path relative to the index directory."""
    if "://" in uri:
        return uri
    path = Path(uri)
    return str(path if path.is_absolute() else directory / path)


def _literal(value: str) -> str:
    """A string literal for a Milvus filter expression (Milvus accepts JSON's escapes)."""
    return json.dumps(value)


class MilvusBackend:
    builds_locally = False  # the Milvus server indexes its collection itself

    def __init__(self, client: object, manifest: Manifest) -> None:
        self.client = client
        self.manifest = manifest
        self.collection = manifest.milvus_collection or MILVUS_COLLECTION
        self.dim = manifest.dim
        _, _, self.search_params = MILVUS_INDEXES[manifest.requested_index_type]
        self.has_taken = True  # False for a collection made before: its items have no capture time

    @classmethod
    def connect(cls, directory: Path, manifest: Manifest, *, uri: str | None = None) -> MilvusBackend:
        """Connect to the manifest's collection, creating it if it does not exist yet."""
        pymilvus = _pymilvus()
        resolved = resolve_uri(uri or manifest.milvus_uri or DEFAULT_LITE_FILE, directory)
        if "://" not in resolved:  # Milvus Lite (adding the same filter twice keeps one)
            logging.getLogger("pymilvus.client.iterator.query_iterator").addFilter(_LITE_ITERATOR_FILTER)
        client = pymilvus.MilvusClient(resolved)
        backend = cls(client, manifest)
        if client.has_collection(backend.collection):
            backend._check_collection()
        else:
            backend._create_collection(manifest.options)
        client.load_collection(backend.collection)
        return backend

    def _create_collection(self, options: IndexOptions) -> None:
        data_type = _pymilvus().DataType
        schema = self.client.create_schema(auto_id=True, enable_dynamic_field=False)
        schema.add_field("id", data_type.INT64, is_primary=True)
        schema.add_field("vector", data_type.FLOAT_VECTOR, dim=self.dim)
        schema.add_field("path", data_type.VARCHAR, max_length=MAX_PATH)
        schema.add_field("label", data_type.VARCHAR, max_length=MAX_LABEL, nullable=True)
        schema.add_field("content_hash", data_type.VARCHAR, max_length=64)
        schema.add_field("added", data_type.VARCHAR, max_length=40)
        schema.add_field(TAKEN, data_type.VARCHAR, max_length=40, nullable=True)
        index_type, build_params, _ = MILVUS_INDEXES[options.index_type]
        index_params = self.client.prepare_index_params()
        index_params.add_index("vector", index_type=index_type, metric_type="COSINE", params=build_params)
        self.client.create_collection(
            self.collection,
            schema=schema,
            index_params=index_params,
            properties={MODEL_PROPERTY: self.manifest.model_fingerprint},
        )
        self.manifest.index_type = index_type

    def _check_collection(self) -> None:
        description = self.client.describe_collection(self.collection)
        fingerprint = (description.get("properties") or {}).get(MODEL_PROPERTY)
        if fingerprint != self.manifest.model_fingerprint:
            raise ValueError(
                f"Milvus collection {self.collection!r} holds vectors of model {str(fingerprint)[:12]}, "
                f"not {self.manifest.model_fingerprint[:12]}: use another --milvus-collection"
            )
        vector = next(field for field in description["fields"] if field["name"] == "vector")
        if int(vector["params"]["dim"]) != self.dim:
            raise ValueError(f"Milvus collection {self.collection!r} has dimension {vector['params']['dim']}")
        self.manifest.index_type = self.client.describe_index(self.collection, "vector")["index_type"]
        # An existing collection keeps the schema it was made with (changing it is the operator's call on a
        # shared server): one from before capture times were kept has no `taken`, and its date filters use
        # the time indexed (index.filters).
        self.has_taken = any(field["name"] == TAKEN for field in description["fields"])

    @property
    def _metadata_fields(self) -> list[str]:
        return [*METADATA_FIELDS, TAKEN] if self.has_taken else METADATA_FIELDS

    @property
    def items(self) -> MilvusBackend:
        return self

    def add(
        self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes | None] | None = None
    ) -> list[int]:
        """``signatures`` are not kept: the collection's schema predates them (see ``signatures``)."""
        vectors = normalize_rows(vectors)
        check_dim(vectors, self.dim)
        if len(vectors) != len(entries):
            raise ValueError(f"{len(vectors)} vectors but {len(entries)} metadata rows")
        added = now_utc()
        rows = []
        for vector, entry in zip(vectors, entries, strict=True):
            path, label, content_hash, taken = Entry(*entry)
            if len(path.encode()) > MAX_PATH:
                raise ValueError(f"path {path[:60]}... is longer than Milvus's {MAX_PATH} bytes")
            row = {
                "vector": vector,
                "path": path,
                "label": label,
                "content_hash": content_hash,
                "added": added,
            }
            if self.has_taken:
                row[TAKEN] = taken
            rows.append(row)
        if not rows:
            return []
        return [int(i) for i in self.client.insert(self.collection, rows)["ids"]]

    def search(
        self, queries: np.ndarray, k: int, where: ItemFilter | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        queries = normalize_rows(queries)
        check_dim(queries, self.dim, "queries")
        if k > MAX_TOP_K:
            raise ValueError(f"Milvus returns at most {MAX_TOP_K} neighbours a query, not {k}")
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        if len(queries) == 0:
            return ids, scores
        params = dict(self.search_params)
        if "ef" in params:  # a graph search returns at most ef results
            filtered = where is not None and not where.empty
            params["ef"] = max(params["ef"] * (FILTERED_EF_FACTOR if filtered else 1), k)
        results = self.client.search(
            self.collection,
            data=list(queries),
            limit=k,
            output_fields=["id"],
            search_params={"metric_type": "COSINE", "params": params},
            filter=where.milvus_expression(TAKEN if self.has_taken else "added") if where is not None else "",
        )
        for row, hits in enumerate(results):
            for column, hit in enumerate(hits):
                ids[row, column] = hit["id"]
                scores[row, column] = hit["distance"]
        return ids, scores

    def remove(self, ids: Sequence[int]) -> int:
        present = sorted(self.get_many(list(ids)))
        if present:
            self.client.delete(self.collection, ids=present)
        return len(present)

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The collection's stored vector field (float32, as inserted)."""
        if len(ids) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        rows = self.client.get(self.collection, ids=[int(i) for i in ids], output_fields=["vector"])
        by_id = {int(row["id"]): row["vector"] for row in rows}
        missing = [int(i) for i in ids if int(i) not in by_id]
        if missing:
            raise KeyError(f"no stored vector for ids {missing[:5]}")
        return np.array([by_id[int(i)] for i in ids], dtype=np.float32)

    def signatures(self) -> dict[int, bytes]:
        """None: a collection has no field for them, and adding one would break existing collections."""
        return {}

    def stats(self) -> dict[str, object]:
        return {}

    def move(self, moves: Sequence[Move]) -> int:
        present = self.get_many([move.id for move in moves])
        rows = [{"id": m.id, "path": m.path, "label": m.label} for m in moves if m.id in present]
        if rows:  # a partial upsert keeps each row's id and vector
            self.client.upsert(self.collection, rows, partial_update=True)
        return len(rows)

    def set_taken(self, taken: Mapping[int, str]) -> int:
        if not self.has_taken:
            return 0
        present = self.get_many(list(taken))
        rows = [{"id": i, TAKEN: time} for i, time in taken.items() if i in present]
        if rows:
            self.client.upsert(self.collection, rows, partial_update=True)
        return len(rows)

    # -- ItemCatalog -------------------------------------------------------------------------------

    def get_many(self, ids: Sequence[int]) -> dict[int, Item]:
        if not ids:
            return {}
        rows = self.client.get(
            self.collection, ids=[int(i) for i in ids], output_fields=self._metadata_fields
        )
        return {int(row["id"]): self._item(row) for row in rows}

    def get(self, item_id: int) -> Item | None:
        return self.get_many([item_id]).get(item_id)

    def get_by_path(self, path: str) -> Item | None:
        rows = self.client.query(
            self.collection, filter=f"path == {_literal(path)}", output_fields=self._metadata_fields, limit=1
        )
        return self._item(rows[0]) if rows else None

    def page(self, offset: int, limit: int) -> list[Item]:
        rows = self.client.query(
            self.collection, filter="id >= 0", output_fields=self._metadata_fields, offset=offset, limit=limit
        )
        return sorted((self._item(row) for row in rows), key=lambda item: item.id)

    def scan(self) -> Iterator[Item]:
        iterator = self.client.query_iterator(
            self.collection, batch_size=PAGE, output_fields=self._metadata_fields
        )
        try:
            while batch := iterator.next():
                yield from (self._item(row) for row in batch)
        finally:
            iterator.close()

    def label_counts(self) -> dict[str, int]:
        # Milvus groups only search results: count over a scan (callers such as the UI cache the answer).
        counts = Counter(item.label for item in self.scan() if item.label is not None)
        return dict(sorted(counts.items()))

    def __len__(self) -> int:
        rows = self.client.query(self.collection, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    @staticmethod
    def _item(row: dict) -> Item:
        fields = (row["path"], row.get("label"), row["content_hash"], row["added"], row.get(TAKEN))
        return Item(int(row["id"]), *fields)

    # -- persistence -------------------------------------------------------------------------------

    def save(self) -> None:
        self.client.flush(self.collection)

    def close(self) -> None:
        self.client.close()
