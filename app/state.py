"""The engine the server shares across requests, loaded once at start-up."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.settings import Settings
from engine.search import SearchService

log = logging.getLogger("dmlsearch.app")


@dataclass
class EngineState:
    """Either a ready :class:`SearchService` or the reason there is none (reported by ``/readyz``)."""

    service: SearchService | None = None
    not_ready_reason: str | None = "not loaded yet"

    @classmethod
    def load(cls, settings: Settings) -> EngineState:
        try:
            service = SearchService.open(
                settings.model_path,
                settings.index_path,
                threads=settings.threads,
                backend=settings.backend,
                milvus_uri=settings.milvus_uri,
                max_pixels=settings.max_image_pixels,
                jpeg_draft=settings.jpeg_draft,
                vote_sigma2=settings.vote_sigma2,
                rerank_pool=settings.rerank_pool,
            )
        except Exception as err:  # any load failure leaves the process up and not ready
            log.error("search engine not ready: %s", err)
            return cls(None, f"{type(err).__name__}: {err}")
        return cls(service, None)

    def size(self) -> int:
        return len(self.service.index) if self.service is not None else -1
