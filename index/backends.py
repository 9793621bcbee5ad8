"""The backends by name: which class holds an index of each ``Backend``, and what each can do.

The one place outside the backends themselves where a backend's name decides anything
(tests/test_backend_names.py): everywhere else, what differs between backends is a ``Capabilities`` fact.
"""

from __future__ import annotations

from pathlib import Path

from foundation.families import Backend
from index.connection import MilvusConnection
from index.faiss_backend import FaissBackend
from index.manifest import Manifest
from index.milvus_backend import MilvusBackend  # imports pymilvus only when it connects
from index.protocol import Capabilities, VectorIndex


def capabilities_of(backend: Backend) -> Capabilities:
    """What an index of ``backend`` can do, known before one is created or opened (a tuning parameter
    only comes with a built index: ``VectorIndex.capabilities``)."""
    return MilvusBackend.CAPABILITIES if backend is Backend.MILVUS else FaissBackend.CAPABILITIES


def connect(
    directory: Path,
    manifest: Manifest,
    *,
    create: bool,
    milvus: MilvusConnection | None = None,
    mapped: bool = True,
    read_only: bool = False,
) -> VectorIndex:
    """The backend of the index in ``directory`` (``create``: a new one), as ``index.gallery.GalleryIndex``
    opens it; ``milvus``: reach its collection otherwise than the manifest records."""
    if manifest.backend is Backend.MILVUS:
        return MilvusBackend.connect(
            directory, manifest, (milvus or MilvusConnection()).over(manifest.milvus), create=create
        )
    if create:
        return FaissBackend.create(directory, manifest)
    return FaissBackend.open(directory, manifest, mapped=mapped, read_only=read_only)
