"""What a run on judgments that learned nothing tells its user (issue 40): judge more, how many, which kind.

Pair losses learn from the pairs a model ranks wrong: a 👎 on a wrong result that the served model scores
above a 👍 of the same query, a *wrong result near the top*. A run learns nothing where it has too few of
them, or too few held-out queries to show what it learned. From the numbers the run saw:

- the training judgments, 👍 and 👎, their queries, and how many of the 👎 are ranked above a 👍 of their
  query by the served vectors (:func:`wrong_near_top`);
- the held-out queries: fewer than :func:`training.bootstrap.fewest_pairs_for` (6) show no gain however
  they moved, so at least that many are needed whatever else the run saw;
- where the interval cleared zero but the sign-flip test did not, the held-out queries that moved: the
  others are ties no test counts, so about ``6 / moved`` times as many held-out queries are needed;
- the held-out gate's difference ``d`` and the half-width ``h`` of its interval: the interval narrows as
  one over the square root of the held-out queries, so ``(h / d)^2`` times as many judged queries would
  make a gain of ``d`` clear of zero (:func:`queries_for_a_clear_gain`). Where ``d <= 0`` nothing scales:
  the run learned nothing from judgments of this kind, and the advice is to double the wrong results
  near the top (judged as the run's were, the top results of as many more queries).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from training.bootstrap import Interval, fewest_pairs_for
from training.feedback_data import JudgedPair


def wrong_near_top(pairs: Sequence[JudgedPair], served: Mapping[int, np.ndarray]) -> tuple[int, int]:
    """(👎 scored above a 👍 of their query by the served vectors, the queries they are on)."""
    by_query: dict[int, tuple[list[float], list[float]]] = {}
    for pair in pairs:
        query, result = (
            np.asarray(served[pair.query], np.float64),
            np.asarray(served[pair.result], np.float64),
        )
        score = float(query @ result / max(float(np.linalg.norm(query) * np.linalg.norm(result)), 1e-12))
        by_query.setdefault(pair.query, ([], []))[0 if pair.sign > 0 else 1].append(score)
    counts = [
        sum(s > min(likes) for s in unlikes) for likes, unlikes in by_query.values() if likes and unlikes
    ]
    return sum(counts), sum(1 for count in counts if count)


def queries_for_a_clear_gain(interval: Interval, queries: int) -> int | None:
    """Held-out queries for the interval around the same gain to clear zero; None where it has no gain."""
    if interval.difference <= 0:
        return None
    half_width = (interval.high - interval.low) / 2
    return math.ceil(queries * (half_width / interval.difference) ** 2)


def judge_more(
    pairs: Sequence[JudgedPair],
    served: Mapping[int, np.ndarray],
    *,
    interval: Interval,
    held_out_queries: int,
    held_out_share: float,
    moved_queries: int | None = None,
) -> str:
    """The advice, in plain words, for a run trained on ``pairs`` whose held-out judgments (``interval``
    over ``held_out_queries``, ``held_out_share`` of the judged queries, ``moved_queries`` of them ranked
    otherwise than before) did not show a gain."""
    likes = sum(pair.sign > 0 for pair in pairs)
    queries = len({pair.query for pair in pairs})
    per_query = len(pairs) / max(queries, 1)
    hard, hard_queries = wrong_near_top(pairs, served)
    seen = (
        f"it trained on {len(pairs)} judgments ({likes} 👍, {len(pairs) - likes} 👎) of {queries} queries, "
        f"and {hard} of its 👎 were on wrong results ranked above a right one (on {hard_queries} of the "
        "queries): "
        "those are what a pair loss learns from"
    )
    if hard == 0:
        return (
            f"judge more: {seen}. The served model already ranks every judged pair right, so there is "
            "nothing to learn: search for photos whose top results are wrong and mark those 👎 (and the "
            "right ones 👍)"
        )
    needed = queries_for_a_clear_gain(interval, held_out_queries)
    least = fewest_pairs_for(interval.level)
    if held_out_queries < least:
        needed = max(needed or 0, least)
        why = (
            f"{held_out_queries} held-out {'query' if held_out_queries == 1 else 'queries'} cannot show a "
            f"gain however they moved: it takes at least {least}, and about {needed} held-out queries would "
            f"do (the gate holds out {100 * held_out_share:.0f}% of the queries with both a 👍 and a 👎)"
        )
        more_queries = math.ceil((needed - held_out_queries) / held_out_share)
    elif interval.low > 0 and moved_queries is not None:  # the interval cleared zero, the sign-flip test not
        needed = math.ceil(held_out_queries * least / max(moved_queries, 1))
        why = (
            f"the held-out judgments gained {100 * interval.difference:+.1f} points, but only "
            f"{moved_queries} of the {held_out_queries} held-out queries moved (the others ranked as "
            f"before), and a gain on fewer than {least} moved queries is too often chance: about {needed} "
            "held-out queries would "
            f"move {least}"
        )
        more_queries = math.ceil((needed - held_out_queries) / held_out_share)
    elif needed is not None and needed > held_out_queries:
        more_queries = math.ceil((needed - held_out_queries) / held_out_share)
        why = (
            f"the held-out judgments gained {100 * interval.difference:+.1f} points, within "
            f"±{50 * (interval.high - interval.low):.1f}: about {needed} held-out queries instead of "
            f"{held_out_queries} would make that gain clear"
        )
    else:
        why = (
            "the held-out judgments did not improve, so more of the same kind may not help: what it "
            "learns from is the wrong results near the top, and as many more queries judged gives it "
            "about twice those"
        )
        more_queries = queries  # judged as these were: as many more queries, about twice those 👎
    return (
        f"judge more: {seen}. {why.capitalize()}. Judge about {math.ceil(more_queries * per_query)} more "
        f"results, the top {round(per_query)} of about {more_queries} more queries, marking 👎 on the wrong "
        "results near the top and 👍 on the right ones"
    )
