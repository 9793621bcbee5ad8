"""The engine the server shares across requests, loaded once at start-up."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from app.settings import Settings
from engine.decode_pool import Decoder
from engine.search import SearchService
from engine.serving import ServingConfig
from index.atomic import remove_abandoned

log = logging.getLogger("dmlsearch.app")


@dataclass
class EngineState:
    """Either a ready :class:`SearchService` or the reason there is none (reported by ``/readyz``)."""

    service: SearchService | None = None
    not_ready_reason: str | None = "not loaded yet"

    @classmethod
    def open(
        cls,
        settings: Settings,
        index_path: Path | None = None,
        model_path: Path | None = None,
        *,
        decoder: Decoder,
    ) -> EngineState:
        """A ready engine over ``index_path`` (default: the configured one) or an exception saying why not.

        ``decoder``: where its images are decoded (the app's decode processes).

        ``model_path`` None: the configured model for the configured index, else the model the index
        carries. The embedder, its PDDM unit and the index come as one :class:`SearchService`, and are
        swapped as one.
        """
        if index_path is None:
            index_path, model_path = settings.index_path, model_path or settings.model_path
        service = SearchService.open(
            model_path,
            index_path,
            threads=settings.threads,
            backend=settings.backend,
            milvus_uri=settings.milvus_uri,
            config=ServingConfig(
                max_pixels=settings.max_image_pixels,
                max_batch_pixels=settings.max_batch_pixels,
                jpeg_draft=settings.jpeg_draft,
                vote_sigma2=settings.vote_sigma2,
                rerank_pool=settings.rerank_pool,
                decoder=decoder,
            ),
        )
        return cls(service, None)

    @classmethod
    def load(cls, settings: Settings, *, decoder: Decoder) -> EngineState:
        """The configured engine, or a not-ready state with the reason (the process stays up)."""
        try:
            state = cls.open(settings, decoder=decoder)
        except Exception as err:  # any load failure leaves the process up and not ready
            log.error("search engine not ready: %s", err)
            return cls(None, f"{type(err).__name__}: {err}")
        if state.service.index.manifest.gallery_root is not None:
            _remove_abandoned_uploads(Path(state.service.index.manifest.gallery_root))
        return state

    def size(self) -> int:
        return len(self.service.index) if self.service is not None else -1


def _remove_abandoned_uploads(gallery: Path) -> None:
    """Temporary files of added images whose write was interrupted: the API writes them into the gallery
    folder and its label folders (the index folder cleans itself when opened)."""
    remove_abandoned(gallery)
    try:
        folders = [path for path in gallery.iterdir() if path.is_dir() and not path.is_symlink()]
    except OSError:
        return
    for folder in folders:
        remove_abandoned(folder)
