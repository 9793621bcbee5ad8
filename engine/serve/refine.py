"""Refining a query by examples: more like these (positive), less like those (negative).

The two strategies are Qdrant's recommendation strategies, as its API reference defines them
(``RecommendStrategy``, https://api.qdrant.tech/api-reference/search/recommend-points, and
https://qdrant.tech/documentation/concepts/explore/#recommendation-api):

- ``average_vector``: "Average positive and negative vectors and create a single query with the formula
  ``query = avg_pos + avg_pos - avg_neg``. Then performs normal search." With no negative, the query is
  ``avg_pos`` (Qdrant's ``avg_vector_for_recommendation``).
- ``best_score``: "Each candidate is compared against all examples, its score is then chosen from the
  ``max(max_pos_score, max_neg_score)``. If the ``max_neg_score`` is chosen then it is squared and negated,
  otherwise it is just the ``max_pos_score``."

Here the query itself is the first positive example: a refined search stays a search for the query, and
the judgments move it. Every vector is L2-normalised (the embedder's and the index's), so a dot product is
the cosine. Qdrant scores best_score over its whole collection while walking its HNSW graph; here the
candidates are the ``candidate_depth`` nearest neighbours of each positive example (the query included),
rescored exactly from their stored vectors. This module is the maths only; ``engine.serve.query`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from foundation import defaults
from foundation.errors import InvalidInputError

# best_score rescores, for each positive example, its max(MIN_CANDIDATES, CANDIDATE_FACTOR x (offset + k))
# nearest neighbours: an item best_score ranks high is near some positive (its score is that cosine), and
# a fixed pool for a fixed page keeps paging with ``offset`` inside one ranking.
MIN_CANDIDATES = 100
CANDIDATE_FACTOR = 4


class Strategy(StrEnum):
    AVERAGE_VECTOR = "average_vector"
    BEST_SCORE = "best_score"


DEFAULT_STRATEGY = Strategy(defaults.REFINE_STRATEGY)


Example = int | bytes  # an indexed item's id, or an uploaded image


class ExamplesError(InvalidInputError):
    """Examples that cannot refine a search: too many, or one both positive and negative."""

    code = "invalid_examples"


@dataclass(frozen=True)
class Refinement:
    """The examples that refine every query of a request, and how they combine."""

    positive: tuple[Example, ...] = ()
    negative: tuple[Example, ...] = ()
    strategy: Strategy = DEFAULT_STRATEGY

    def __post_init__(self) -> None:
        count = len(self.positive) + len(self.negative)
        if count > defaults.MAX_EXAMPLES:
            raise ExamplesError(
                f"at most {defaults.MAX_EXAMPLES} positive and negative examples in all, got {count}",
                code="too_many_examples",
            )
        both = set(self.positive) & set(self.negative)
        if both:
            raise ExamplesError(
                f"{_named(both)} both a positive and a negative example: judge each once",
                code="conflicting_examples",
            )

    @property
    def item_ids(self) -> list[int]:
        """The examples that are indexed items, positive first (each once)."""
        return list(dict.fromkeys(e for e in (*self.positive, *self.negative) if isinstance(e, int)))

    @property
    def uploads(self) -> list[bytes]:
        """The uploaded images, positive first (each once)."""
        return list(dict.fromkeys(e for e in (*self.positive, *self.negative) if isinstance(e, bytes)))

    def refuse_negative_query(self, item_id: int) -> None:
        """The query item is a positive example: it may not be a negative one too."""
        if item_id in self.negative:
            raise ExamplesError(
                f"item {item_id} is the query, so it cannot be a negative example",
                code="conflicting_examples",
            )


def _named(examples: set[Example]) -> str:
    ids = sorted(e for e in examples if isinstance(e, int))
    images = len(examples) - len(ids)
    parts = ([f"item {', '.join(map(str, ids))}"] if ids else []) + (
        [f"{images} uploaded image(s)"] if images else []
    )
    return " and ".join(parts) + (" is" if len(examples) == 1 else " are")


def average_vector(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Qdrant's ``average_vector`` query: ``2 avg(positive) - avg(negative)``, ``avg(positive)`` with no
    negative; ``positive`` (p, d) with p >= 1, ``negative`` (n, d). Not normalised: the index search is."""
    mean_positive = positive.mean(axis=0)
    if len(negative) == 0:
        return mean_positive
    return 2.0 * mean_positive - negative.mean(axis=0)


def best_score(candidates: np.ndarray, positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Qdrant's ``best_score`` of each candidate (c, d) against ``positive`` (p, d), p >= 1, and
    ``negative`` (n, d): its best cosine to a positive where that beats its best cosine to a negative,
    else minus the square of the latter."""
    best_positive = (candidates @ positive.T).max(axis=1)
    if len(negative) == 0:
        return best_positive
    best_negative = (candidates @ negative.T).max(axis=1)
    return np.where(best_positive > best_negative, best_positive, -np.square(best_negative))


def candidate_depth(depth: int) -> int:
    """How many nearest neighbours of each positive example best_score rescores, for ``depth`` results."""
    return max(MIN_CANDIDATES, CANDIDATE_FACTOR * depth)


def ranked(scores: np.ndarray, ids: Sequence[int]) -> list[int]:
    """Positions of ``scores`` best first; equal scores in id order, so that a ranking is reproducible."""
    return sorted(range(len(ids)), key=lambda i: (-float(scores[i]), ids[i]))
