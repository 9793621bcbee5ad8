"""``manifest.json``: what an index directory holds, how it was built and which model made its vectors.

An index directory (FAISS) holds ``manifest.json``, ``items.sqlite`` (items and their vectors) and
``vectors.faiss``; a Milvus one holds the manifest (and a Milvus Lite file). Since indexes carry their
model, it also holds the model its vectors were embedded with: ``model.onnx``, its card ``model.json``,
and the PDDM unit the card names, if any (``engine.model.bundle`` writes and reads them; ``model_file`` names
the model, ``None`` for indexes built before). Copying the directory copies a servable search engine.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, model_validator

from foundation import defaults
from foundation.atomic import atomic_write_text
from foundation.errors import DmlsearchError, InvalidInputError, NotFoundError
from foundation.families import Backend, IndexType
from foundation.regular_files import read_regular
from index.connection import MilvusConnection
from index.milvus_access import public_uri
from index.selection import IndexOptions

FORMAT_VERSION = 3
READABLE_VERSIONS = (2, FORMAT_VERSION)  # 2: what was requested and built as flat fields, moved on load
MANIFEST_NAME = "manifest.json"
MILVUS_COLLECTION = "dmlsearch"  # the collection a Milvus index uses unless told otherwise
_OPTIONS = IndexOptions()  # the defaults of what is asked for


class Requested(BaseModel):
    """What was asked for: kept so a re-run of build-index without options builds the same kind of index."""

    model_config = ConfigDict(frozen=True)

    index_type: IndexType = _OPTIONS.index_type
    memory_budget: int | None = _OPTIONS.memory_budget
    target_recall: float = _OPTIONS.target_recall


class BuiltIndex(BaseModel):
    """What was built, as the backend returns it (``VectorIndex.built_index``)."""

    model_config = ConfigDict(frozen=True)

    # "flat" | "hnsw" | "ivf" | "ivfpq" (FAISS), the Milvus index type, or "none" yet.
    index_type: str = "none"
    index_spec: str | None = None  # the faiss index_factory string
    search_params: dict[str, int] = Field(default_factory=dict)  # nprobe / efSearch chosen by tuning
    achieved_recall: float | None = None  # recall@10 vs exact search measured when tuning
    recall_queries: int = 0
    tuned_count: int | None = None  # items when the search parameters were tuned (None: not recorded)


# Format 2's top-level names of the requested options (``index stats`` still prints them so).
FLAT_REQUESTED = {
    "requested_index_type": "index_type",
    "memory_budget": "memory_budget",
    "target_recall": "target_recall",
}


class Manifest(BaseModel):
    """Written only by ``index.gallery.GalleryIndex``."""

    format_version: int = FORMAT_VERSION
    backend: Backend = Backend.FAISS
    requested: Requested = Field(default_factory=Requested)
    built: BuiltIndex = Field(default_factory=BuiltIndex)
    dim: int
    metric: str = "cosine"
    count: int = 0
    model_fingerprint: str
    model_file: str | None = None  # the stored model (beside its card), None for indexes built before
    gallery_root: str | None = None
    shard: str | None = None  # "I/N" for a directory holding one shard of a gallery
    # Never written with the credentials a URI may carry (index.milvus_access): a manifest read with them
    # (written before) logs in with them until its next save.
    milvus_uri: str | None = None
    milvus_collection: str | None = None
    created: str
    updated: str
    # Random, given at creation (None for indexes created before): tells another index that took this
    # index's path from this one saved again, where ``created`` (to the second) may be the same.
    identity: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nest_format_2(cls, data: Any) -> Any:
        """A format-2 manifest kept what was requested and built as top-level fields: nest them."""
        if not isinstance(data, dict) or data.get("format_version") != 2:
            return data
        data = dict(data)
        data["requested"] = {new: data.pop(old) for old, new in FLAT_REQUESTED.items() if old in data}
        data["built"] = {name: data.pop(name) for name in BuiltIndex.model_fields if name in data}
        data["format_version"] = FORMAT_VERSION
        return data

    @field_serializer("milvus_uri")
    def _without_credentials(self, uri: str | None) -> str | None:
        return None if uri is None else public_uri(uri)

    @property
    def origin(self) -> tuple[str, str | None]:
        """Which index this is: the same for every save of it, another for another index at its path."""
        return self.created, self.identity

    @property
    def milvus(self) -> MilvusConnection:
        """Where its Milvus collection was when it was built (fields None for an index of another backend)."""
        return MilvusConnection(self.milvus_uri, self.milvus_collection)

    @property
    def options(self) -> IndexOptions:
        requested = self.requested
        return IndexOptions(requested.index_type, requested.memory_budget, requested.target_recall)

    def set_options(self, options: IndexOptions) -> None:
        self.requested = Requested(
            index_type=options.index_type,
            memory_budget=options.memory_budget,
            target_recall=options.target_recall,
        )

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_NAME
        if not path.exists():
            raise NotFoundError(f"{directory} is not an index directory (no manifest.json)")
        try:
            manifest = cls.model_validate_json(read_regular(path, defaults.MANIFEST_BYTES))
        except ValidationError as err:  # not the JSON of a manifest: a damaged file, not a bug
            raise InvalidInputError(str(err)) from err
        if manifest.format_version != FORMAT_VERSION:
            raise InvalidInputError(
                f"index format {manifest.format_version} is not supported (expected "
                f"{' or '.join(map(str, READABLE_VERSIONS))}): "
                "rebuild the index with dmlsearch build-index"
            )
        return manifest

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / MANIFEST_NAME, self.model_dump_json(indent=2))


class DiskChange(Enum):
    """What became of an index directory's manifest since an object read or wrote it: the one answer the
    server, its reloader and the watcher act on (``GalleryIndex.disk_change``)."""

    UNCHANGED = "unchanged"  # the same manifest, or none at all (nothing there to follow)
    SAVED = "saved"  # the same index saved again, by another process or object (the same origin)
    REPLACED = "replaced"  # another index took the path (another origin), or no index manifest is there


# The manifest file's inode and modification time: every save replaces it atomically (a new inode).
ManifestStamp = tuple[int, int]


def manifest_stamp(directory: Path) -> ManifestStamp | None:
    """Identifies the manifest on disk (None: there is none)."""
    try:
        stat = (directory / MANIFEST_NAME).stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def disk_change(directory: Path, stamp: ManifestStamp | None, origin: tuple[str, str | None]) -> DiskChange:
    """How the manifest in ``directory`` changed since it was ``stamp``, for the index of ``origin``
    (``Manifest.origin``); the manifest is read only when its stamp changed."""
    now = manifest_stamp(directory)
    if now is None or now == stamp:
        return DiskChange.UNCHANGED
    try:
        found = Manifest.load(directory).origin
    except (DmlsearchError, OSError):  # no index's manifest any more: something else took the path
        return DiskChange.REPLACED
    return DiskChange.SAVED if found == origin else DiskChange.REPLACED
