"""From one query's cosine hits to the page a client sees: re-ranked order, global ranks, vote, paging."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.serve.voting import Prediction, knn_vote
from index.gallery import Hit

# rerank=pddm re-scores the top max(rerank_pool, RERANK_POOL_FACTOR x k) cosine neighbours: deep enough
# that the unit can lift items the cosine ranked a few pages down, and a fixed pool for a fixed k, so that
# paging with ``offset`` walks through one re-ranked list.
RERANK_POOL_FACTOR = 4


@dataclass(frozen=True)
class SearchResult:
    id: int
    path: str
    label: str | None
    score: float  # cosine similarity to the query
    rank: int
    pddm_score: float | None = None  # S(query, item) of the PDDM unit, with rerank="pddm"


@dataclass(frozen=True)
class QueryHits:
    results: list[SearchResult]
    prediction: Prediction | None = None


def rerank_depth(k: int, rerank_pool: int) -> int:
    """How many cosine neighbours rerank=pddm re-scores for a page of ``k``: max(rerank_pool, 4k)."""
    return max(rerank_pool, RERANK_POOL_FACTOR * k)


def rank_page(
    hits: Sequence[Hit],
    pddm: np.ndarray | None,
    *,
    k: int,
    offset: int,
    predict: bool,
    vote_sigma2: float,
) -> QueryHits:
    """Order ``hits`` (by their PDDM scores when given, else as the index ranked them), number them, vote
    over the top ``offset + k`` when ``predict`` (weighted by their cosine scores, re-ranked or not) and
    cut the page ``[offset, offset + k)``."""
    # A stable sort: equal PDDM scores keep their cosine order.
    order = range(len(hits)) if pddm is None else np.argsort(-pddm, kind="stable")
    pddm_scores = [None] * len(hits) if pddm is None else pddm.tolist()
    ranked = []
    for rank, i in enumerate(order, start=1):
        hit = hits[i]
        ranked.append(
            SearchResult(hit.item.id, hit.item.path, hit.item.label, hit.score, rank, pddm_scores[i])
        )
    prediction = None
    if predict:
        voters = ranked[: offset + k]
        prediction = knn_vote([r.label for r in voters], [r.score for r in voters], sigma2=vote_sigma2)
    return QueryHits(ranked[offset : offset + k], prediction)
