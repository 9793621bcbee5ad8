"""What the query service and the item writer share: the served bundle (an index and its loaded model),
swapped as one unit, the lock around it, and the serving rules both apply to images.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.decode.model_input import PixelBudget
from engine.decode.pool import Decoder, InProcessDecoder
from engine.model.bundle import ModelFile, locate_model
from engine.model.embedder import Embedder
from engine.model.explainer import Explainer
from engine.model.reranker import PDDMReranker
from foundation import defaults
from foundation.locks import ReadWriteLock
from index.connection import MilvusConnection
from index.gallery import GalleryIndex
from index.manifest import DiskChange


@dataclass(frozen=True)
class LoadedBundle:
    """An index with the model that embedded it (and the model's PDDM unit, if it has one), loaded.

    Everything one search needs, so that a reload replaces it as one unit: a query never meets an index
    embedded by another model than its own.
    """

    embedder: Embedder
    index: GalleryIndex
    reranker: PDDMReranker | None = None
    explainer: Explainer | None = None  # splits similarities over image positions (``engine.serve.explain``)

    def __post_init__(self) -> None:
        self.index.check_model(self.embedder.fingerprint, self.embedder.dim)

    @classmethod
    def open(
        cls,
        model: ModelFile | Path | None,
        index_dir: Path,
        *,
        threads: int = 0,
        backend: str | None = None,
        milvus: MilvusConnection | None = None,
        run_seconds: float | None = None,
    ) -> LoadedBundle:
        """``model``: located already (``locate_model``), a path checked to be the index's model, or None
        to serve the model the index carries; ``backend``: refuse an index of another backend; ``milvus``:
        where its Milvus collection is. The model's PDDM unit is loaded too when its card names one (a
        model exported from a pddm run), and its explainer when it has one. ``run_seconds``: the deadline
        of each model run (:class:`engine.model.embedder.EmbedTimeoutError`)."""
        if not isinstance(model, ModelFile):
            model = locate_model(index_dir, model)
        embedder = Embedder(model.path, threads=threads, run_seconds=run_seconds, card=model.card)
        index = cls.open_index(index_dir, backend=backend, milvus=milvus)
        reranker = PDDMReranker.for_model(embedder.model_path, embedder.card, threads=threads)
        explainer = Explainer.for_model(embedder.model_path, embedder.card, threads=threads)
        return cls(embedder, index, reranker, explainer)

    @staticmethod
    def open_index(
        index_dir: Path, *, backend: str | None = None, milvus: MilvusConnection | None = None
    ) -> GalleryIndex:
        """An index to serve: a FAISS file is read into memory, not mapped, so that another process
        overwriting it in place (``cp new.faiss vectors.faiss``) cannot kill the server with SIGBUS."""
        return GalleryIndex.open(index_dir, backend=backend, milvus=milvus, mapped=False)

    def unseen_change(self) -> DiskChange:
        """How the index's directory changed on disk in a way this bundle serves only once its index is
        opened again (FAISS: another process's save, another index at its path); a server's collection
        (Milvus) is live, its changes seen without a reload: unchanged."""
        if not self.index.capabilities.reopen_to_see_saves:
            return DiskChange.UNCHANGED
        return self.index.disk_change()

    def with_index(self, index: GalleryIndex) -> LoadedBundle:
        """The same model over another index (checked to be embedded by it)."""
        return replace(self, index=index)

    @property
    def rerankers(self) -> list[str]:
        """The ``rerank`` values this bundle can answer: ``pddm`` when the model carries its PDDM unit
        (every index backend gives the candidates' stored vectors back)."""
        return ["pddm"] if self.reranker is not None else []


class CurrentBundle:
    """The bundle being served and the readers-writer lock around it: searches share it, a write (add,
    remove) or a swap (reload) has it alone."""

    def __init__(self, bundle: LoadedBundle) -> None:
        self.bundle = bundle
        self.lock = ReadWriteLock()

    @contextmanager
    def reading(self) -> Iterator[LoadedBundle]:
        with self.lock.read():
            yield self.bundle

    @contextmanager
    def writing(self) -> Iterator[LoadedBundle]:
        with self.lock.write():
            yield self.bundle

    def swap(self, bundle: LoadedBundle) -> LoadedBundle:
        """Serve ``bundle`` from now on and close what the old one does not share; returns the bundle served.

        The swap waits for the searches and writes under way, and no write runs during it. An index that
        sees saves only when opened again (FAISS), opened before a write of this process (or another) saved
        its directory, is read again first, under the same lock: every write acknowledged before the swap
        is in the index served after it.
        """
        with self.lock.write():
            index = bundle.index
            if bundle.unseen_change() is not DiskChange.UNCHANGED:
                reopened = LoadedBundle.open_index(index.directory, backend=index.manifest.backend)
                try:
                    fresh = bundle.with_index(reopened)  # rebuilt with another model meanwhile: refused
                except ValueError:
                    reopened.close()
                    raise
                bundle.index.close()
                bundle = fresh
            old, self.bundle = self.bundle, bundle
        if old.index is not bundle.index:
            old.index.close()
        return bundle


@dataclass(frozen=True)
class ServingConfig:
    """The serving rules (``app.settings`` sets them for the API)."""

    max_pixels: int = defaults.MAX_IMAGE_PIXELS
    max_batch_pixels: int = defaults.MAX_BATCH_PIXELS
    jpeg_draft: bool = defaults.JPEG_DRAFT
    vote_sigma2: float = defaults.VOTE_SIGMA2
    rerank_pool: int = defaults.RERANK_POOL
    # Where untrusted images are decoded: the server gives a DecodePool (limits on time and memory).
    decoder: Decoder = field(default_factory=InProcessDecoder)

    def __post_init__(self) -> None:
        if self.rerank_pool < 1:
            raise ValueError(f"rerank_pool must be at least 1, got {self.rerank_pool}")

    def budget(self, embedder: Embedder) -> PixelBudget:
        """What one request may decode for ``embedder``.

        JPEG draft decoding: libjpeg scales by 1/2..1/8 while decoding, keeping the short side at least the
        model's resize size, so a 12-MP photo is not decoded in full only to be shrunk to 224 px.
        """
        draft_size = embedder.card.preprocessing.resize_size if self.jpeg_draft else None
        return PixelBudget(self.max_pixels, self.max_batch_pixels, draft_size)
