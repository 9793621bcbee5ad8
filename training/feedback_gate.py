"""The gate of a run trained on judgments (issue 40): served only where it is better on judgments held out,
and not worse on the photos nobody judged.

The held-out judgments (:mod:`training.feedback_data`: whole queries, never trained on or selected on) are
scored twice: by the vectors the index serves now (the model before) and by the trained model's embeddings
of the same photos. For each held-out query, its **ranking precision** is the share of its (👍, 👎) pairs
whose 👍 result the query's vector scores above the 👎 one (cosine; a tie counts half), as the results
page would rank them. The run passes where the paired bootstrap interval of the mean difference over the
queries (:func:`training.bootstrap.paired_bootstrap`, as the validation gain) lies above zero, and the paired
randomization test (:func:`training.bootstrap.sign_flip_p_value`) agrees at the same level.

Why both: over the few held-out queries of a few dozen judgments (a fifth of 5 judged queries is one) the
percentile interval is no proof. One query resampled is that query each time, so the interval of one query
that moved up lies above zero; a model no better than the served one passed that way in 48.7% of draws
with one held-out query, 24.5% with two, 13.3% with three and still 4.3% with ten, against the 2.5% the
interval's level promises (bench/results/feedback_gate_small.md; with the test too: 0% below 6 queries,
at most 2.6% from 6 on). The randomization test is exact at any number of queries and can say "better"
only from 6 on (2^-6 < 2.5%): with fewer the gate has no verdict, refuses the run and says how many
queries to judge.

Judgments name a few classes; training on them can spoil the rest of the gallery, which nobody judged and
which has no labels. The second check, :class:`UnjudgedCheck`, is the label-free trainer's own
(:mod:`training.label_free_data`) on a sample of the unjudged photos (:mod:`training.feedback_rows`): each
photo as served and as an augmented view, Recall@1 over those rows (is a photo's nearest other row its own
view?), trained against served, per photo, the same paired bootstrap; and how far their neighbourhoods
moved: the mean share of each one's :data:`NEIGHBOURHOOD` nearest unjudged photos that it keeps. The run
passes only where the view check is not *worse* and at least :data:`MIN_NEIGHBOURS_KEPT` is kept.

Why the neighbourhoods: replayed on Cars196 (bench/results/feedback_gate_unjudged.md, 27 runs of 11 losses
on 5 cross-validation cells), the view check alone let through most runs whose Recall@1 on the unjudged
classes fell (the photos' own views stay findable while class neighbourhoods are reshuffled). The share
kept told them apart: the 13 runs that lost R@1 kept 0.63-0.72 of their neighbours, 6 of the 7 that gained
kept 0.76-0.85 (one, +1.06, kept 0.66 and is refused).

A held-out judgment is *right* under a model where it ranks on its side of the query's others: a 👍 above
every 👎 of its query, a 👎 below every 👍. The report lists those the training *fixed* (wrong before, right
after) and *broke* (right before, wrong after).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, field_serializer, field_validator

from training.bootstrap import Interval, fewest_pairs_for, paired_bootstrap, sign_flip_p_value
from training.feedback_data import JudgedPair
from training.metrics import nearest_neighbours, top_hits

NEIGHBOURHOOD = 10  # the nearest unjudged photos whose share kept the gate reads
# The least share of their NEIGHBOURHOOD nearest the unjudged photos keep on average for a run to pass:
# set after the replay's seed-1 cells (between 0.67, the most a run that lost R@1 kept, and 0.78, the least
# of one that gained), then checked on seed 0 fold 1 and seed 2, and on seeds 3 and 4 (both folds), never
# used to choose it: no run that lost R@1 kept 0.75 (the most: 0.72); chosen by leave-one-cell-out
# without a margin, 2 runs that fell pass in 1 of 7 cells (bench/results/feedback_gate_threshold.md).
MIN_NEIGHBOURS_KEPT = 0.75


class JudgmentRecord(BaseModel):
    """One held-out judgment, as the report lists it."""

    query: int
    result: int
    sign: int


class UnjudgedCheck(BaseModel):
    """The label-free check of the unjudged photos (module docstring)."""

    model_config = ConfigDict(frozen=True)

    photos: int
    baseline: str  # "served": the index's model; "backbone": the untrained backbone (another model served)
    recall_before: float  # share of rows whose nearest other row is the same photo, by the baseline
    recall_after: float  # by the trained model
    interval: Interval  # of recall_after - recall_before, photos resampled
    neighbours_kept: float  # mean share of each photo's NEIGHBOURHOOD nearest unjudged photos kept

    @field_validator("interval", mode="before")
    @classmethod
    def _read_interval(cls, value: Any) -> Any:
        return Interval.from_dict(value) if isinstance(value, dict) else value

    @field_serializer("interval")
    def _write_interval(self, interval: Interval) -> dict[str, Any]:
        return interval.to_dict()

    @property
    def passed(self) -> bool:
        return self.interval.verdict != "worse" and self.neighbours_kept >= MIN_NEIGHBOURS_KEPT

    def describe(self) -> str:
        interval = self.interval
        moved = (
            ""
            if self.neighbours_kept >= MIN_NEIGHBOURS_KEPT
            else f" (under {100 * MIN_NEIGHBOURS_KEPT:.0f}%: moved too far)"
        )
        return (
            f"unjudged photos ({self.photos}, label-free: each found again from an augmented view): "
            f"Recall@1 {100 * self.recall_after:.1f} trained vs {100 * self.recall_before:.1f} "
            f"{self.baseline}, "
            f"difference {100 * interval.difference:+.1f} ({100 * interval.level:.0f}% CI "
            f"[{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]): {interval.verdict}; "
            f"{100 * self.neighbours_kept:.0f}% of their {NEIGHBOURHOOD} nearest kept{moved}"
        )


def unjudged_check(
    items: np.ndarray, before: np.ndarray, after: np.ndarray, *, baseline: str, seed: int
) -> UnjudgedCheck:
    """The check on the unjudged ``items``: ``before`` and ``after`` embed each as served, then as its view
    (2n rows each)."""
    ids = np.concatenate([items, items])
    hits_before, hits_after = top_hits(before, ids).hit, top_hits(after, ids).hit
    served = len(items)
    k = min(NEIGHBOURHOOD, served - 1)
    kept = 0.0
    if k > 0:
        around_before = nearest_neighbours(before[:served], k)
        around_after = nearest_neighbours(after[:served], k)
        kept = float(
            np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(around_before, around_after, strict=True)])
        )
    return UnjudgedCheck(
        photos=served,
        baseline=baseline,
        recall_before=float(hits_before.mean()),
        recall_after=float(hits_after.mean()),
        interval=paired_bootstrap(hits_after.astype(float), hits_before.astype(float), seed=seed),
        neighbours_kept=kept,
    )


class FeedbackGate(BaseModel):
    """What ``summary.json`` records of a run trained on judgments, and whether it may be served."""

    model_config = ConfigDict(frozen=True)

    index: str
    judgments_trained: int  # the training judgments (one per judged pair, the latest sign)
    judgments_validation: int  # held out to select the checkpoint (a run on judgments alone)
    judgments_held_out: int  # held out for this gate
    uploads_left_out: int  # judgments of uploaded queries: no photo to train from
    queries_held_out: int  # the held-out queries ranked (each with a 👍 and a 👎)
    queries_moved: int | None = None  # those whose ranking precision changed (None: an older summary)
    precision_before: float  # mean ranking precision by the index's served vectors
    precision_after: float  # by the trained model
    interval: Interval  # of precision_after - precision_before, queries resampled
    # one-sided, the same difference by the paired randomization test; None: a run from before it was asked,
    # whose judgments are not taken as better
    p_value: float | None = None
    fixed: list[JudgmentRecord]
    broke: list[JudgmentRecord]
    unjudged: UnjudgedCheck | None = None  # None: a run from before the check (its summary.json)
    judge_more: str | None = None  # where the judgments showed no gain: what to judge (feedback_advice)

    @field_validator("interval", mode="before")
    @classmethod
    def _read_interval(cls, value: Any) -> Any:
        return Interval.from_dict(value) if isinstance(value, dict) else value

    @field_serializer("interval")
    def _write_interval(self, interval: Interval) -> dict[str, Any]:
        return interval.to_dict()

    @property
    def too_few_queries(self) -> bool:
        """Fewer held-out queries than any test at the interval's level can call better from."""
        return self.queries_held_out < fewest_pairs_for(self.interval.level)

    @property
    def judgments_better(self) -> bool:
        significant = self.p_value is not None and self.p_value < (1 - self.interval.level) / 2
        return self.interval.verdict == "better" and significant

    @property
    def passed(self) -> bool:
        return self.judgments_better and (self.unjudged is None or self.unjudged.passed)

    def describe(self) -> str:
        interval = self.interval
        unjudged = "" if self.unjudged is None else f"; {self.unjudged.describe()}"
        advice = "" if self.judge_more is None else f"; {self.judge_more}"
        return (
            f"held-out judgments ({self.judgments_held_out} on {self.queries_held_out} queries): ranking "
            f"precision {100 * self.precision_after:.1f} trained vs {100 * self.precision_before:.1f} "
            "served, "
            f"difference {100 * interval.difference:+.1f} ({100 * interval.level:.0f}% CI "
            f"[{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"
            f"{'' if self.p_value is None else f', sign-flip p {self.p_value:.3f}'}): {self.verdict()}; "
            f"{len(self.fixed)} fixed, {len(self.broke)} broken; "
            f"trained on {self.judgments_trained} judgments{unjudged}{advice}"
        )

    def verdict(self) -> str:
        """The held-out judgments' verdict in words."""
        if self.too_few_queries:
            least = fewest_pairs_for(self.interval.level)
            return (
                f"no verdict from {self.queries_held_out} held-out "
                f"{'query' if self.queries_held_out == 1 else 'queries'} (it takes at least {least}: with "
                f"fewer, a model no better than the served one improves them all by chance too often)"
            )
        return "better" if self.judgments_better else "not better"


def _by_query(pairs: Sequence[JudgedPair]) -> dict[int, tuple[list[int], list[int]]]:
    """query -> (👍 results, 👎 results), for the queries with both."""
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for pair in pairs:
        groups.setdefault(pair.query, ([], []))[0 if pair.sign > 0 else 1].append(pair.result)
    return {query: group for query, group in groups.items() if group[0] and group[1]}


def rank_judgments(
    vectors: Mapping[int, np.ndarray], pairs: Sequence[JudgedPair]
) -> tuple[np.ndarray, dict[JudgedPair, bool]]:
    """Per ranked query (in order of first appearance) its ranking precision, and per judgment of those
    queries whether it is right (module docstring), under ``vectors`` (item -> vector)."""

    def unit(item: int) -> np.ndarray:
        vector = np.asarray(vectors[item], dtype=np.float64)
        return vector / max(float(np.linalg.norm(vector)), 1e-12)

    precisions: list[float] = []
    right: dict[JudgedPair, bool] = {}
    for query, (likes, unlikes) in _by_query(pairs).items():
        anchor = unit(query)
        like = np.array([unit(item) @ anchor for item in likes])
        unlike = np.array([unit(item) @ anchor for item in unlikes])
        order = np.sign(like[:, None] - unlike[None, :])  # +1 where the 👍 ranks above the 👎
        precisions.append(float(((order + 1) / 2).mean()))
        for item, score in zip(likes, like, strict=True):
            right[JudgedPair(query, item, 1)] = bool(score > unlike.max())
        for item, score in zip(unlikes, unlike, strict=True):
            right[JudgedPair(query, item, -1)] = bool(score < like.min())
    return np.array(precisions), right


def feedback_gate(
    *,
    index: str,
    trained: int,
    validation: int,
    held_out: Sequence[JudgedPair],
    uploads: int,
    before: Mapping[int, np.ndarray],
    after: Mapping[int, np.ndarray],
    unjudged: UnjudgedCheck | None,
    seed: int,
) -> FeedbackGate:
    """The gate on ``held_out`` judgments: ``before`` the index's served vectors, ``after`` the trained
    model's embeddings (item -> vector, every item the judgments name); and the ``unjudged`` photos' check
    (None where no photo is left unjudged)."""
    precision_before, right_before = rank_judgments(before, held_out)
    precision_after, right_after = rank_judgments(after, held_out)
    if len(precision_before) == 0:
        raise ValueError("no held-out query has both a 👍 and a 👎: nothing to rank")
    fixed = [pair for pair, ok in right_after.items() if ok and not right_before[pair]]
    broke = [pair for pair, ok in right_after.items() if not ok and right_before[pair]]
    return FeedbackGate(
        index=index,
        judgments_trained=trained,
        judgments_validation=validation,
        judgments_held_out=len(held_out),
        uploads_left_out=uploads,
        queries_held_out=len(precision_before),
        queries_moved=int(np.count_nonzero(precision_after != precision_before)),
        precision_before=float(precision_before.mean()),
        precision_after=float(precision_after.mean()),
        interval=paired_bootstrap(precision_after, precision_before, seed=seed),
        p_value=sign_flip_p_value(precision_after, precision_before, seed=seed),
        fixed=[JudgmentRecord(query=p.query, result=p.result, sign=p.sign) for p in fixed],
        broke=[JudgmentRecord(query=p.query, result=p.result, sign=p.sign) for p in broke],
        unjudged=unjudged,
    )
