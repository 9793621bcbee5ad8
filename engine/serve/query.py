"""The query service: one ``search(queries, options)`` for an uploaded image, a batch of them, or an item.

Queries are decoded one by one, embedded as one batch and searched as one batch; then each is re-ranked
when asked, ranked, voted on and cut to its page (``engine.serve.ranking``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from engine.decode.model_input import RUN_IMAGES, decode_uploads
from engine.decode.regions import Box
from engine.serve.item_reader import ItemReader, image_path
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from engine.serve.ranking import QueryHits, rank_page, rerank_depth
from foundation import defaults
from foundation.errors import InvalidInputError
from foundation.regular_files import read_image_file
from foundation.timing import StageTimer
from index.filters import ItemFilter
from index.gallery import Hit


@dataclass(frozen=True)
class SearchOptions:
    """What a client asks of a search, the same for every query of a request.

    New ways to narrow a search (filters on the items) belong here: the service hands the options down to
    the index search and the ranking, and routes and commands pass them along whole.
    """

    k: int = defaults.TOP_K
    min_score: float = defaults.MIN_SCORE
    offset: int = 0  # skip this many of the best results (paging); ranks stay global
    predict: bool = False
    rerank: str | None = None
    where: ItemFilter | None = None  # only items it lets through (label, path prefix, time added)


@dataclass(frozen=True)
class ItemQuery:
    """Search by an indexed item: its stored image is the query, and the item itself is left out."""

    item_id: int


Query = bytes | ItemQuery  # an uploaded image, or an item of the index


@dataclass(frozen=True)
class BatchResponse:
    queries: list[QueryHits]  # one per query, in order
    took_ms: float
    model_fingerprint: str
    timings_ms: dict[str, float]


class RerankUnavailableError(InvalidInputError):
    """A re-ranking was asked for that the served model cannot do."""

    code = "rerank_unavailable"


class QueryService:
    def __init__(self, current: CurrentBundle, reader: ItemReader, config: ServingConfig) -> None:
        self.current = current
        self.reader = reader
        self.config = config

    def search(
        self, queries: Sequence[Query], options: SearchOptions, boxes: Sequence[Box | None] | None = None
    ) -> BatchResponse:
        """Search with each query; raises ``ImageDecodeError`` for a bad image, named by its position
        (``image 2:``) when there are several, before any model work is done (and for queries over the
        request's pixel budget, before any image is decoded); ``ItemNotFoundError`` for an unknown item.

        ``boxes``: one per query (None: the whole image), the region of its upright image to search by
        (``engine.decode.regions``); a box that does not fit its image raises ``BoxError``, before any model
        work.

        Decoding and embedding run outside the bundle's lock, the search under it. A reload that swapped
        in another model meanwhile has the queries embedded again by it, under the lock: vectors of one
        model never meet the index of another, and the answer names the model that searched.
        """
        bundle = self.current.bundle
        self._check(options, bundle)
        timer = StageTimer()
        vectors = self._embed(queries, boxes, bundle, timer, self.reader.image_path)
        excluded = [query.item_id if isinstance(query, ItemQuery) else None for query in queries]
        with self.current.reading() as served:
            if served.embedder is not bundle.embedder:
                self._check(options, served)
                vectors = self._embed(queries, boxes, served, timer, partial(image_path, served))
            candidates = self._candidates(served, vectors, excluded, options, timer)
        hits = [
            rank_page(
                hits,
                pddm,
                k=options.k,
                offset=options.offset,
                predict=options.predict,
                vote_sigma2=self.config.vote_sigma2,
            )
            for hits, pddm in candidates
        ]
        return BatchResponse(hits, timer.elapsed_ms(), served.embedder.fingerprint, timer.ms)

    def _embed(
        self,
        queries: Sequence[Query],
        boxes: Sequence[Box | None] | None,
        bundle: LoadedBundle,
        timer: StageTimer,
        item_image: Callable[[int], Path],
    ) -> np.ndarray:
        embedder = bundle.embedder
        with timer.stage("decode"):
            images = [
                read_image_file(item_image(query.item_id)) if isinstance(query, ItemQuery) else query
                for query in queries
            ]
            budget, preprocessing = self.config.budget(embedder), embedder.card.preprocessing
            decoded = self.config.decoder.run(
                decode_uploads, images, budget, preprocessing, boxes=boxes, images=len(images)
            )
        timer.include(decoded.ms, within="decode")
        with timer.stage("embed"):
            return embedder.embed_tensor(decoded.tensor, run_size=RUN_IMAGES)

    def _check(self, options: SearchOptions, bundle: LoadedBundle) -> None:
        if options.k < 1 or options.offset < 0:
            raise ValueError(f"k must be >= 1 and offset >= 0, got k={options.k}, offset={options.offset}")
        if options.rerank is not None and options.rerank not in bundle.rerankers:
            card = bundle.embedder.card
            raise RerankUnavailableError(
                f"the served model ({card.backbone}, loss {card.loss or 'none'}) cannot re-rank with "
                f"{options.rerank!r}: rerank=pddm needs a model exported with its PDDM scoring unit "
                "(dmlsearch export of a run trained with --loss pddm)"
            )

    def _candidates(
        self,
        bundle: LoadedBundle,
        vectors: np.ndarray,
        excluded: Sequence[int | None],
        options: SearchOptions,
        timer: StageTimer,
    ) -> list[tuple[list[Hit], np.ndarray | None]]:
        """Each query's hits, less its excluded item and the hits below ``min_score`` (a cosine cut,
        re-ranked or not), with their PDDM scores when asked; call it under the bundle's lock (the
        candidates' vectors are read before a write removes them).

        With rerank, the page is taken from the re-ranked pool (``engine.serve.ranking.rerank_depth``): an
        ``offset`` past the pool gives short or empty pages, and the vote is over the top ``offset + k``
        of the re-ranked list, weighted by their cosine scores like any vote.
        """
        if options.rerank:
            depth = rerank_depth(options.k, self.config.rerank_pool)
        else:
            depth = options.offset + options.k
        # One extra neighbour for a query item, which is dropped from its own results.
        extra = any(item_id is not None for item_id in excluded)
        with timer.stage("search"):
            hit_lists = [
                [hit for hit in hits if hit.item.id != exclude and hit.score >= options.min_score]
                if exclude is not None
                else [hit for hit in hits[:depth] if hit.score >= options.min_score]
                for hits, exclude in zip(
                    bundle.index.search(vectors, depth + extra, options.where), excluded, strict=True
                )
            ]
        pddm_lists: list[np.ndarray | None] = [None] * len(hit_lists)
        if options.rerank:
            with timer.stage("rerank"):
                pairs = zip(vectors, hit_lists, strict=True)
                pddm_lists = [_pddm_scores(bundle, vector, hits) for vector, hits in pairs]
        return list(zip(hit_lists, pddm_lists, strict=True))


def _pddm_scores(bundle: LoadedBundle, query: np.ndarray, hits: Sequence[Hit]) -> np.ndarray:
    """S(query, candidate) for each hit, from the candidates' stored (exact, not re-embedded) vectors."""
    ids = [hit.item.id for hit in hits]
    assert bundle.reranker is not None  # _check refuses rerank for a model without its PDDM unit
    return bundle.reranker.score(query, bundle.index.vectors(ids))
