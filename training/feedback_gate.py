"""The gate of a run trained on judgments (issue 40): served only where it is better on judgments held out.

The held-out judgments (:mod:`training.feedback_data`: whole queries, never trained on or selected on) are
scored twice: by the vectors the index serves now (the model before) and by the trained model's embeddings
of the same photos. For each held-out query, its **ranking precision** is the share of its (👍, 👎) pairs
whose 👍 result the query's vector scores above the 👎 one (cosine; a tie counts half), as the results
page would rank them. The run passes where the paired bootstrap interval of the mean difference over the
queries (:func:`training.bootstrap.paired_bootstrap`, as the validation gain) lies above zero.

A held-out judgment is *right* under a model where it ranks on its side of the query's others: a 👍 above
every 👎 of its query, a 👎 below every 👍. The report lists those the training *fixed* (wrong before, right
after) and *broke* (right before, wrong after).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, field_serializer, field_validator

from training.bootstrap import Interval, paired_bootstrap
from training.feedback_data import JudgedPair


class JudgmentRecord(BaseModel):
    """One held-out judgment, as the report lists it."""

    query: int
    result: int
    sign: int


class FeedbackGate(BaseModel):
    """What ``summary.json`` records of a run trained on judgments, and whether it may be served."""

    model_config = ConfigDict(frozen=True)

    index: str
    judgments_trained: int  # the training judgments (one per judged pair, the latest sign)
    judgments_validation: int  # held out to select the checkpoint (a run on judgments alone)
    judgments_held_out: int  # held out for this gate
    uploads_left_out: int  # judgments of uploaded queries: no photo to train from
    queries_held_out: int  # the held-out queries ranked (each with a 👍 and a 👎)
    precision_before: float  # mean ranking precision by the index's served vectors
    precision_after: float  # by the trained model
    interval: Interval  # of precision_after - precision_before, queries resampled
    fixed: list[JudgmentRecord]
    broke: list[JudgmentRecord]

    @field_validator("interval", mode="before")
    @classmethod
    def _read_interval(cls, value: Any) -> Any:
        return Interval.from_dict(value) if isinstance(value, dict) else value

    @field_serializer("interval")
    def _write_interval(self, interval: Interval) -> dict[str, Any]:
        return interval.to_dict()

    @property
    def passed(self) -> bool:
        return self.interval.verdict == "better"

    def describe(self) -> str:
        interval = self.interval
        return (
            f"held-out judgments ({self.judgments_held_out} on {self.queries_held_out} queries): ranking "
            f"precision {100 * self.precision_after:.1f} trained vs {100 * self.precision_before:.1f} "
            "served, "
            f"difference {100 * interval.difference:+.1f} ({100 * interval.level:.0f}% CI "
            f"[{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]): {interval.verdict}; "
            f"{len(self.fixed)} fixed, {len(self.broke)} broken; "
            f"trained on {self.judgments_trained} judgments"
        )


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
    seed: int,
) -> FeedbackGate:
    """The gate on ``held_out`` judgments: ``before`` the index's served vectors, ``after`` the trained
    model's embeddings (item -> vector, every item the judgments name)."""
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
        precision_before=float(precision_before.mean()),
        precision_after=float(precision_after.mean()),
        interval=paired_bootstrap(precision_after, precision_before, seed=seed),
        fixed=[JudgmentRecord(query=p.query, result=p.result, sign=p.sign) for p in fixed],
        broke=[JudgmentRecord(query=p.query, result=p.result, sign=p.sign) for p in broke],
    )
