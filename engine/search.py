"""The search engine that the API, the UI and `dmlsearch query` hold: a served bundle and its jobs.

:class:`SearchService` joins a :class:`LoadedBundle` (an index and the model that embedded it) to the
services sharing it under one readers-writer lock (searches run side by side; a write or a reload waits
for them and runs alone): ``queries`` (``engine.query``), ``reader`` (``engine.item_reader``), ``writer``
(``engine.item_writer``) and ``duplicates`` (``engine.duplicates``). A reload swaps the bundle as one
unit (``CurrentBundle.swap``).
"""

from __future__ import annotations

from pathlib import Path

from engine.duplicates import DuplicateFinder
from engine.embedder import Embedder
from engine.item_reader import ItemReader
from engine.item_writer import ItemWriter
from engine.query import QueryService
from engine.serving import CurrentBundle, LoadedBundle, ServingConfig
from index.gallery import GalleryIndex


class SearchService:
    def __init__(self, bundle: LoadedBundle, config: ServingConfig | None = None) -> None:
        self.config = config or ServingConfig()
        self.current = CurrentBundle(bundle)
        self.reader = ItemReader(self.current, max_pixels=self.config.max_pixels, decoder=self.config.decoder)
        self.queries = QueryService(self.current, self.reader, self.config)
        self.writer = ItemWriter(self.current, self.config)
        self.duplicates = DuplicateFinder(self.current)

    @classmethod
    def open(
        cls,
        model_path: Path | None,
        index_dir: Path,
        *,
        threads: int = 0,
        backend: str | None = None,
        milvus_uri: str | None = None,
        config: ServingConfig | None = None,
    ) -> SearchService:
        """Load the bundle (see :meth:`LoadedBundle.open`) and serve it under ``config``."""
        bundle = LoadedBundle.open(
            model_path, index_dir, threads=threads, backend=backend, milvus_uri=milvus_uri
        )
        return cls(bundle, config)

    @property
    def index(self) -> GalleryIndex:
        return self.current.bundle.index

    @property
    def embedder(self) -> Embedder:
        return self.current.bundle.embedder

    @property
    def model_fingerprint(self) -> str:
        return self.embedder.fingerprint

    @property
    def rerankers(self) -> list[str]:
        return self.current.bundle.rerankers

    def reload_if_changed(self) -> bool:
        """Swap in the FAISS index from disk when another process saved it (``dmlsearch watch``,
        ``build-index``, ``index add``); returns whether it did.

        The new index is opened beside the old one while searches go on; they wait only for the swap.
        (Milvus collections are live: their changes are seen without this.)
        """
        index = self.index
        if index.manifest.backend != "faiss" or not index.saved_elsewhere():
            return False
        fresh = GalleryIndex.open(index.directory, backend="faiss")
        try:
            bundle = self.current.bundle.with_index(fresh)  # checks the index against the model
        except ValueError:
            fresh.close()
            raise
        self.current.swap(bundle).index.close()
        return True

    def close(self) -> None:
        self.index.close()
