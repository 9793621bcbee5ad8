"""The small protocols every backend implements, and the one place vectors are L2-normalised."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from foundation.errors import DmlsearchError, ErrorKind

if TYPE_CHECKING:
    from index.filters import ItemFilter
    from index.judgments import JudgmentStore
    from index.manifest import BuiltIndex
    from index.selection import IndexOptions

UNIT_TOLERANCE = 1e-6  # a few float32 ulps around 1.0


@dataclass(frozen=True)
class Entry:
    """What an index is told about a new item."""

    path: str  # relative to the gallery folder
    label: str | None
    content_hash: str
    taken: str | None = None  # when the photo was taken (see ``Item.taken``)


@dataclass(frozen=True)
class Item:
    id: int
    path: str
    label: str | None
    content_hash: str
    added: str  # when it was indexed: ISO 8601 in UTC
    # When the photo was taken, on the camera's clock: ISO 8601 "YYYY-MM-DDTHH:MM:SS", with the UTC offset
    # when known ("+02:00"). From EXIF, else the file's time; None for items indexed before it was kept
    # (filters then use ``added``, see ``index.filters``).
    taken: str | None = None


@dataclass(frozen=True)
class Move:
    """An item whose file was renamed or moved: same content, so same id and vector, new path and label."""

    id: int
    path: str
    label: str | None


class IndexNotBuiltError(DmlsearchError, RuntimeError):
    """Vectors were stored but the search structure has not been built yet (an interrupted build)."""

    kind = ErrorKind.CONFLICT
    code = "index_not_built"


class BackendUnavailableError(DmlsearchError, RuntimeError):
    """The index's server (Milvus) failed a request or cannot be reached; the message is the server's.
    Not the caller's input: the API answers 503, the command line names the server and its message."""

    kind = ErrorKind.UNAVAILABLE
    code = "index_unavailable"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by the backend and checked by ``GalleryIndex`` and its callers."""

    local_build: bool  # this process builds the search structure (``build``); else its server indexes itself
    removes_in_place: bool  # a removed item leaves the search structure without a rebuild
    # Items copy in under given ids and times (``copy_in``: index merge, index rebuild) and a build can
    # take them in partitions, one per shard.
    mergeable: bool
    gpu_capable: bool  # the search structure can run on a GPU in this process
    tuning_parameter: str | None  # the search-time knob tuned to the target recall (None: none here)
    # The whole index lives in its folder (FAISS files), so a new one can be written aside and swapped in;
    # else its vectors live in a server (Milvus; Milvus Lite: a file it holds open) and it fills in place.
    lives_in_folder: bool
    # Another process's save is seen only by opening the index again (its files are read into memory);
    # else this process sees it live (a server's collection).
    reopen_to_see_saves: bool
    # Every item can be listed for the price of reading a local file; else each listing is a server scan.
    lists_items_cheaply: bool


class ItemCatalog(Protocol):
    """Item metadata by stable int64 id."""

    def get(self, item_id: int) -> Item | None: ...

    def get_many(self, ids: Sequence[int]) -> dict[int, Item]: ...

    def get_by_path(self, path: str) -> Item | None: ...

    def get_by_content(self, content_hash: str) -> Item | None:
        """An item whose file has the content ``content_hash`` (sha256 hex), or None."""
        ...

    def page(self, offset: int, limit: int) -> list[Item]:
        """Items in id order, ``limit`` of them after skipping ``offset``."""
        ...

    def scan(self) -> Iterator[Item]:
        """Every item, in id order."""
        ...

    def label_counts(self) -> dict[str, int]:
        """How many items carry each label, by label (items without a label are not counted)."""
        ...

    def __len__(self) -> int: ...


class VectorIndex(Protocol):
    """A backend: top-k cosine search over stored vectors, with stable int64 ids and item metadata.

    Only ``index.gallery.GalleryIndex`` holds one. ``add`` stores vectors with their metadata (and each
    item's perceptual signature, where given and the backend keeps them: ``signatures`` gives them back)
    and returns the ids it gave them; ``move`` changes items' paths and labels only; ``search`` returns
    ``(ids, scores)``, both (n, k), with id -1 and score -inf where fewer than k items exist; ``vectors``
    gives back stored vectors (exact, as added after normalising); ``save`` makes everything durable; a
    backend is loaded again by its ``open`` or ``connect`` class method. ``capabilities`` says which of
    ``build``, ``copy_in`` and ``reserve_ids`` do anything: the others refuse (``CapabilityError``).
    A backend reads the manifest it was opened with but never writes it: ``built_index`` returns what it
    built, and the ``GalleryIndex`` records it.
    """

    dim: int

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def items(self) -> ItemCatalog: ...

    @property
    def judgments(self) -> JudgmentStore:
        """The index's judgments, kept where every process serving it sees them; those naming an item
        are deleted with it by ``remove``."""
        ...

    @property
    def built(self) -> bool:
        """Whether the search structure exists (a server-indexed backend: always)."""
        ...

    def gallery_mark(self) -> str | None:
        """The mark of the gallery folder that every process writing to these vectors shares
        (``record_gallery_mark``), or None: none recorded, or vectors that live in the index's folder, which
        no other process writes to."""
        ...

    def record_gallery_mark(self, mark: str) -> None:
        """Record ``mark`` where every process serving these vectors reads it (``gallery_mark``)."""
        ...

    def built_index(self) -> BuiltIndex:
        """What the search structure is and how it was tuned, for the manifest."""
        ...

    def add(
        self, vectors: np.ndarray, entries: Sequence[Entry], signatures: Sequence[bytes | None] | None = None
    ) -> list[int]: ...

    def copy_in(
        self,
        vectors: np.ndarray,
        entries: Sequence[Entry],
        signatures: Sequence[bytes | None],
        *,
        added: Sequence[str],
        ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Add items copied from another index, keeping when they were added (and ``ids``, if given)."""
        ...

    def reserve_ids(self, last_id: int) -> None:
        """Hand out new ids above ``last_id`` (the highest id of the index items were copied from)."""
        ...

    def last_id(self) -> int:
        """The highest id ever handed out, removed items' included."""
        ...

    def build(
        self,
        options: IndexOptions,
        *,
        retune: bool,
        partitions: Sequence[np.ndarray] | None = None,
        progress: bool = False,
    ) -> bool:
        """(Re)build or re-tune the search structure for ``options``; returns whether it was rebuilt."""
        ...

    def search(
        self, queries: np.ndarray, k: int, where: ItemFilter | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``where``: only items it lets through are returned."""
        ...

    def remove(self, ids: Sequence[int]) -> int: ...

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of ``ids``, (len(ids), dim), in that order; KeyError for an unknown id."""
        ...

    def signatures(self, ids: Sequence[int] | None = None) -> dict[int, bytes]:
        """The stored perceptual signatures of ``ids`` (default: every item's) by item id (empty where
        the backend keeps none)."""
        ...

    def stats(self) -> dict[str, object]:
        """Live facts particular to this backend, for ``index stats``."""
        ...

    def move(self, moves: Sequence[Move]) -> int:
        """Give items a new path and label; returns how many existed."""
        ...

    def set_taken(self, taken: Mapping[int, str]) -> int:
        """Record when items' photos were taken (items indexed before it was kept); returns how many
        items took it (none where the backend's store has no place for it)."""
        ...

    def __len__(self) -> int: ...

    def save(self) -> None: ...

    def close(self) -> None: ...


class CapabilityError(DmlsearchError, ValueError):
    """Asked a backend for something its capabilities do not include (merging Milvus collections)."""

    code = "not_supported_by_backend"


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    """The one place vectors are L2-normalised, so every backend's scores are cosines in [-1, 1].

    Idempotent to the bit: rows already of unit length (to float32 precision) are left as they are, so
    stored vectors copied between indexes (merges, rebuilds) stay identical.
    """
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"expected a 2-d array of vectors, got shape {vectors.shape}")
    if not np.isfinite(vectors).all():
        raise ValueError("vectors contain NaN or infinite values")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    norms[np.abs(norms - 1.0) < UNIT_TOLERANCE] = 1.0
    return vectors / np.maximum(norms, 1e-12)


# How far a stored vector's length may be from 1 (float32 rounding of a normalised vector is ~1e-7).
STORED_UNIT_TOLERANCE = 1e-3


def not_unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Which stored vectors are damaged: not finite, or neither of unit length nor zero (vectors are
    stored normalised)."""
    norms = np.linalg.norm(vectors, axis=1)
    return ~np.isfinite(norms) | ((np.abs(norms - 1.0) > STORED_UNIT_TOLERANCE) & (norms != 0))


def check_dim(vectors: np.ndarray, dim: int, what: str = "vectors") -> None:
    if vectors.shape[1] != dim:
        raise ValueError(f"{what} have dimension {vectors.shape[1]}, the index holds {dim}")
