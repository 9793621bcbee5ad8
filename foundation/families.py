"""The closed sets an index is described by, each spelled once: FAISS index families and backends."""

from __future__ import annotations

from enum import StrEnum


class IndexType(StrEnum):
    """A FAISS index family (index/selection.py says when each is chosen); ``AUTO`` asks for the choice."""

    AUTO = "auto"
    FLAT = "flat"
    HNSW = "hnsw"
    IVF = "ivf"
    IVFSQ = "ivfsq"
    IVFPQ = "ivfpq"


class Backend(StrEnum):
    """Where an index keeps its vectors."""

    FAISS = "faiss"
    MILVUS = "milvus"
