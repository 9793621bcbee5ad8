"""The search engine that the API, the UI and `dmlsearch query` hold: a served bundle and its jobs.

:class:`SearchService` joins a :class:`LoadedBundle` (an index and the model that embedded it) to the
services sharing it under one readers-writer lock (searches run side by side; a write or a reload waits for
them and runs alone): ``queries`` (``engine.serve.query``), ``reader`` (``engine.serve.item_reader``),
``writer`` (``engine.serve.item_writer``), ``feedback`` (``engine.serve.feedback``), ``duplicates``
(``engine.duplicates.finder``) and ``explanations`` (``engine.serve.explain``). A reload swaps the bundle
as one unit (``CurrentBundle.swap``), the one way the served bundle changes (``app.reload``).
"""

from __future__ import annotations

from pathlib import Path

from engine.duplicates.finder import DuplicateFinder
from engine.model.embedder import Embedder
from engine.serve.explain import ExplainService
from engine.serve.feedback import FeedbackKeeper
from engine.serve.item_reader import ItemReader
from engine.serve.item_writer import ItemWriter
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from engine.serve.query import QueryService
from index.connection import MilvusConnection
from index.gallery import GalleryIndex


class SearchService:
    def __init__(self, bundle: LoadedBundle, config: ServingConfig | None = None) -> None:
        self.config = config or ServingConfig()
        self.current = CurrentBundle(bundle)
        self.reader = ItemReader(self.current, max_pixels=self.config.max_pixels, decoder=self.config.decoder)
        self.queries = QueryService(self.current, self.reader, self.config)
        self.writer = ItemWriter(self.current, self.config)
        self.feedback = FeedbackKeeper(self.current, self.config)
        self.duplicates = DuplicateFinder(self.current, self.config.decoder)
        self.explanations = ExplainService(self.current, self.reader, self.config)

    @classmethod
    def open(
        cls,
        model_path: Path | None,
        index_dir: Path,
        *,
        threads: int = 0,
        backend: str | None = None,
        milvus: MilvusConnection | None = None,
        config: ServingConfig | None = None,
    ) -> SearchService:
        """Load the bundle (see :meth:`LoadedBundle.open`) and serve it under ``config``."""
        bundle = LoadedBundle.open(model_path, index_dir, threads=threads, backend=backend, milvus=milvus)
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

    def swap(self, bundle: LoadedBundle) -> LoadedBundle:
        """Serve ``bundle`` from now on (``CurrentBundle.swap``: after the writes under way, with every
        acknowledged write in it); returns the bundle served."""
        return self.current.swap(bundle)

    def close(self) -> None:
        self.index.close()
