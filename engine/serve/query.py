"""The query service: one ``search(queries, options)`` for an uploaded image, a batch of them, or an item.

Queries are decoded one by one, embedded as one batch and searched as one batch; then each is re-ranked
when asked, ranked, voted on and cut to its page (``engine.serve.ranking``). A search refined by examples
(``SearchOptions.refine``) embeds its uploaded examples in the same batch, reads its item examples' stored
vectors, and searches or rescores by the strategy's maths (``engine.serve.refine``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from engine.decode.model_input import RUN_IMAGES, decode_uploads
from engine.decode.pool import gallery_memory_is_the_servers
from engine.decode.regions import Box
from engine.serve.item_reader import ItemNotFoundError, ItemReader, image_path
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from engine.serve.ranking import QueryHits, rank_page, rerank_depth
from engine.serve.refine import (
    Refinement,
    Strategy,
    average_vector,
    best_score,
    candidate_depth,
    ranked,
)
from foundation import defaults
from foundation.errors import InvalidInputError
from foundation.timing import StageTimer
from index.filters import ItemFilter
from index.gallery import Hit
from index.protocol import Item


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
    # More like these, less like those (engine.serve.refine): every query of the request is refined by
    # the same examples, which are left out of the results.
    refine: Refinement | None = None


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

        With ``options.refine``, an uploaded example is decoded and embedded with the queries (a bad one
        is named by its position after them); an item example that is not indexed raises
        ``ItemNotFoundError``.

        Decoding and embedding run outside the bundle's lock, the search under it. A reload that swapped
        in another model meanwhile has the queries embedded again by it, under the lock: vectors of one
        model never meet the index of another, and the answer names the model that searched.
        """
        bundle = self.current.bundle
        query_items = [query.item_id if isinstance(query, ItemQuery) else None for query in queries]
        self._check(options, bundle, query_items)
        timer = StageTimer()
        # Uploaded examples ride in the queries' batch, searched by the whole image.
        uploads = options.refine.uploads if options.refine else []
        images = [*queries, *uploads]
        all_boxes = None if boxes is None else [*boxes, *([None] * len(uploads))]
        vectors = self._embed(images, all_boxes, bundle, timer, self.reader.image_path)
        with self.current.reading() as served:
            if served.embedder is not bundle.embedder:
                self._check(options, served, query_items)
                vectors = self._embed(images, all_boxes, served, timer, partial(image_path, served))
            candidates = self._candidates(served, vectors, query_items, options, timer)
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
            # An item's file by its path: the decode process reads it, not this one.
            images = [
                item_image(query.item_id) if isinstance(query, ItemQuery) else query for query in queries
            ]
            budget, preprocessing = self.config.budget(embedder), embedder.card.preprocessing
            with gallery_memory_is_the_servers(images):
                decoded = self.config.decoder.run(
                    decode_uploads, images, budget, preprocessing, boxes=boxes, images=len(images)
                )
        timer.include(decoded.ms, within="decode")
        with timer.stage("embed"):
            return embedder.embed_tensor(decoded.tensor, run_size=RUN_IMAGES)

    def _check(self, options: SearchOptions, bundle: LoadedBundle, query_items: Sequence[int | None]) -> None:
        if options.k < 1 or options.offset < 0:
            raise ValueError(f"k must be >= 1 and offset >= 0, got k={options.k}, offset={options.offset}")
        if options.refine is not None:
            if options.rerank is not None:
                raise RerankUnavailableError(
                    f"rerank={options.rerank} does not combine with positive or negative examples: the "
                    "examples already decide the order (search with one or the other)"
                )
            for item_id in query_items:
                if item_id is not None:
                    options.refine.refuse_negative_query(item_id)
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
        query_items: Sequence[int | None],
        options: SearchOptions,
        timer: StageTimer,
    ) -> list[tuple[list[Hit], np.ndarray | None]]:
        """Each query's hits, less its query item, its examples and the hits below ``min_score`` (a cut
        of the score that orders them: the cosine, re-ranked or not, or a refinement's), with their PDDM
        scores when asked; ``vectors``: the queries', then the uploaded examples'. Call it under the
        bundle's lock (the examples' and candidates' vectors are read before a write removes them).

        With rerank, the page is taken from the re-ranked pool (``engine.serve.ranking.rerank_depth``): an
        ``offset`` past the pool gives short or empty pages, and the vote is over the top ``offset + k``
        of the re-ranked list, weighted by their cosine scores like any vote.
        """
        if options.rerank:
            depth = rerank_depth(options.k, self.config.rerank_pool)
        else:
            depth = options.offset + options.k
        queries, uploaded = vectors[: len(query_items)], vectors[len(query_items) :]
        refine = options.refine
        example_ids = refine.item_ids if refine else []
        excluded = [{*example_ids, *([] if item is None else [item])} for item in query_items]
        with timer.stage("search"):
            if refine is None:
                hit_lists = _nearest(bundle, queries, depth, excluded, options.where)
            else:
                positive, negative = _example_vectors(bundle, refine, uploaded)
                with_query = [np.vstack([query[None], positive]) for query in queries]
                if refine.strategy is Strategy.AVERAGE_VECTOR:
                    refined = np.stack([average_vector(p, negative) for p in with_query])
                    hit_lists = _nearest(bundle, refined, depth, excluded, options.where)
                else:
                    hit_lists = _best_scored(bundle, with_query, negative, excluded, depth, options.where)
            hit_lists = [[hit for hit in hits if hit.score >= options.min_score] for hits in hit_lists]
        pddm_lists: list[np.ndarray | None] = [None] * len(hit_lists)
        if options.rerank:
            with timer.stage("rerank"):
                pairs = zip(queries, hit_lists, strict=True)
                pddm_lists = [_pddm_scores(bundle, vector, hits) for vector, hits in pairs]
        return list(zip(hit_lists, pddm_lists, strict=True))


def _nearest(
    bundle: LoadedBundle,
    vectors: np.ndarray,
    depth: int,
    excluded: Sequence[set[int]],
    where: ItemFilter | None,
) -> list[list[Hit]]:
    """The ``depth`` nearest neighbours of each vector, less its excluded items (searched for as many
    more)."""
    extra = max((len(exclude) for exclude in excluded), default=0)
    return [
        [hit for hit in hits if hit.item.id not in exclude][:depth]
        for hits, exclude in zip(bundle.index.search(vectors, depth + extra, where), excluded, strict=True)
    ]


def _example_vectors(
    bundle: LoadedBundle, refine: Refinement, uploaded: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The positive and the negative examples' vectors: item examples' as stored (exact), uploaded ones'
    as just embedded (``uploaded``, in ``refine.uploads``' order)."""
    ids = refine.item_ids
    found = bundle.index.items.get_many(ids)
    missing = [item_id for item_id in ids if item_id not in found]
    if missing:
        raise ItemNotFoundError(f"no item with id {', '.join(map(str, missing))} (named as an example)")
    vector_of: dict[int | bytes, np.ndarray] = dict(zip(refine.uploads, uploaded, strict=True))
    if ids:
        vector_of.update(zip(ids, bundle.index.vectors(ids), strict=True))
    dim = uploaded.shape[1]

    def stacked(examples: Sequence[int | bytes]) -> np.ndarray:
        return np.array([vector_of[example] for example in examples], dtype=np.float32).reshape(-1, dim)

    return stacked(refine.positive), stacked(refine.negative)


def _best_scored(
    bundle: LoadedBundle,
    positives: Sequence[np.ndarray],
    negative: np.ndarray,
    excluded: Sequence[set[int]],
    depth: int,
    where: ItemFilter | None,
) -> list[list[Hit]]:
    """best_score's top ``depth`` for each query (its positives: the query, then the examples): the
    candidates are the nearest neighbours of each positive (``candidate_depth``), rescored exactly from
    their stored vectors; one index search for every positive of every query."""
    pool = candidate_depth(depth) + max((len(exclude) for exclude in excluded), default=0)
    rows = iter(bundle.index.search(np.vstack(positives), pool, where))
    hit_lists: list[list[Hit]] = []
    for positive, exclude in zip(positives, excluded, strict=True):
        candidates: dict[int, Item] = {}
        for hits in (next(rows) for _ in positive):
            candidates.update((hit.item.id, hit.item) for hit in hits if hit.item.id not in exclude)
        ids = list(candidates)
        if not ids:
            hit_lists.append([])
            continue
        scores = best_score(bundle.index.vectors(ids), positive, negative)
        order = ranked(scores, ids)[:depth]
        hit_lists.append(
            [Hit(candidates[ids[i]], float(scores[i]), rank) for rank, i in enumerate(order, start=1)]
        )
    return hit_lists


def _pddm_scores(bundle: LoadedBundle, query: np.ndarray, hits: Sequence[Hit]) -> np.ndarray:
    """S(query, candidate) for each hit, from the candidates' stored (exact, not re-embedded) vectors."""
    ids = [hit.item.id for hit in hits]
    assert bundle.reranker is not None  # _check refuses rerank for a model without its PDDM unit
    return bundle.reranker.score(query, bundle.index.vectors(ids))
