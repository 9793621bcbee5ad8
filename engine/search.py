"""The search service used by the API, the UI and ``dmlsearch query`` alike."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.embedder import Embedder
from engine.images import DEFAULT_MAX_PIXELS, decode_image
from index.gallery import GalleryIndex


@dataclass(frozen=True)
class SearchResult:
    id: int
    path: str
    label: str | None
    score: float
    rank: int


@dataclass(frozen=True)
class SearchResponse:
    results: list[SearchResult]
    took_ms: float
    model_fingerprint: str


class SearchService:
    """An embedder joined to an index built with the same model."""

    def __init__(
        self, embedder: Embedder, index: GalleryIndex, *, max_pixels: int = DEFAULT_MAX_PIXELS
    ) -> None:
        index.check_model(embedder.fingerprint, embedder.dim)
        self.embedder = embedder
        self.index = index
        self.max_pixels = max_pixels

    @classmethod
    def open(cls, model_path: Path, index_dir: Path, *, threads: int = 0) -> SearchService:
        return cls(Embedder(model_path, threads=threads), GalleryIndex.open(index_dir))

    def search(self, image_bytes: bytes, k: int = 10, min_score: float = -1.0) -> SearchResponse:
        """Decode, embed and search one image; raises ``ImageDecodeError`` for a bad upload."""
        started = time.perf_counter()
        image = decode_image(
            image_bytes, max_pixels=self.max_pixels, draft_size=self.embedder.card.preprocessing.resize_size
        )
        vector = self.embedder.embed([image])
        results = self.search_vectors(vector, k, min_score)[0]
        return SearchResponse(results, (time.perf_counter() - started) * 1000.0, self.embedder.fingerprint)

    def search_vectors(
        self, vectors: np.ndarray, k: int, min_score: float = -1.0
    ) -> list[list[SearchResult]]:
        return [
            [
                SearchResult(hit.item.id, hit.item.path, hit.item.label, hit.score, hit.rank)
                for hit in hits
                if hit.score >= min_score
            ]
            for hits in self.index.search(vectors, k)
        ]

    def image_path(self, item_id: int) -> Path | None:
        """The gallery file of an item, refusing anything that resolves outside the gallery root."""
        item = self.index.items.get(item_id)
        root = self.index.manifest.gallery_root
        if item is None or root is None:
            return None
        root_path = Path(root).resolve()
        path = (root_path / item.path).resolve()
        if not path.is_relative_to(root_path) or not path.is_file():
            return None
        return path
