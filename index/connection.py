"""How to reach the server an index's vectors live in (Milvus): recorded in the index's manifest when it is
built, and given again by whoever opens it elsewhere (``serve --milvus-uri``)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from index.milvus_access import public_uri


@dataclass(frozen=True)
class MilvusConnection:
    """Where a Milvus index's collection is, and what reaching it takes; one value travels where the
    address and collection went as separate arguments. A field left None is what the index recorded
    (else the defaults: the Milvus Lite file in the index directory, ``index.manifest.MILVUS_COLLECTION``).
    Credentials and TLS settings are not: they come from the environment (``index.milvus_access``)."""

    uri: str | None = None  # http://host:19530, or a Milvus Lite file (relative: to the index directory)
    collection: str | None = None

    def __repr__(self) -> str:  # never the credentials a URI may carry
        uri = None if self.uri is None else public_uri(self.uri)
        return f"MilvusConnection(uri={uri!r}, collection={self.collection!r})"

    def over(self, recorded: MilvusConnection) -> MilvusConnection:
        """``recorded`` (what the index's manifest holds) with what this connection gives instead."""
        given = {
            field.name: value for field in fields(self) if (value := getattr(self, field.name)) is not None
        }
        return replace(recorded, **given)

    def server_only(self) -> MilvusConnection:
        """How to reach the server, naming no collection: an existing index keeps the one it records."""
        return replace(self, collection=None)

    def absolute(self) -> MilvusConnection:
        """A local Milvus Lite path given on the command line made absolute, to be recorded; a remote URI
        kept as given."""
        if self.uri is None or "://" in self.uri:
            return self
        return replace(self, uri=str(Path(self.uri).resolve()))
