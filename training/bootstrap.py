"""Paired bootstrap confidence interval on a difference of per-query scores, and the verdict it supports.

Two models answer the same queries against the same gallery, so their per-query results are paired; the
bootstrap resamples *queries* with replacement (Efron and Tibshirani, 1993) and takes the percentile
interval of the mean difference. The verdict only says "better" or "worse" when the whole interval lies on
one side of zero.

Over a handful of queries the percentile interval claims more than it knows: resampling one query gives
that query every time, so a single query that moved up is an interval above zero. Where the queries are
few, :func:`sign_flip_p_value` is the test to ask as well: Fisher's paired randomization test, exact, whose
smallest p-value over ``n`` queries is ``2^-n`` (:func:`fewest_pairs_for`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import numpy as np
from scipy.stats import permutation_test

Verdict = Literal["better", "not distinguishable", "worse"]

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95
BLOCK_ELEMENTS = 1 << 22  # resampled indices held at once: bounds memory for large query sets


@dataclass(frozen=True)
class Interval:
    """The observed mean difference and its bootstrap interval at ``level``."""

    difference: float
    low: float
    high: float
    level: float
    resamples: int

    @property
    def verdict(self) -> Verdict:
        if self.low > 0:
            return "better"
        if self.high < 0:
            return "worse"
        return "not distinguishable"

    def to_dict(self) -> dict[str, float | int | str]:
        return {**asdict(self), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Interval:
        """The interval ``to_dict`` wrote (its verdict is derived, not read back)."""
        return cls(**{field.name: record[field.name] for field in fields(cls)})


def paired_bootstrap(
    first: np.ndarray,
    second: np.ndarray,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> Interval:
    """Interval on ``mean(first - second)`` over queries, from ``resamples`` resamplings of the queries."""
    difference = np.asarray(first, dtype=np.float64) - np.asarray(second, dtype=np.float64)
    if difference.ndim != 1 or len(difference) == 0:
        raise ValueError("paired_bootstrap needs two equally long, non-empty 1-d arrays")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    count = len(difference)
    block = max(1, BLOCK_ELEMENTS // count)
    means = np.concatenate(
        [
            difference[rng.integers(0, count, size=(min(block, resamples - start), count))].mean(axis=1)
            for start in range(0, resamples, block)
        ]
    )
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(float(difference.mean()), float(low), float(high), level, resamples)


def _mean_difference(first: np.ndarray, second: np.ndarray, axis: int) -> np.ndarray:
    return np.mean(first - second, axis=axis)


def sign_flip_p_value(first: np.ndarray, second: np.ndarray, *, seed: int = 0) -> float:
    """One-sided p-value of ``mean(first - second) > 0`` by the paired randomization test: under "no
    difference" each pair's two scores are exchangeable, so every swap (a sign flip of its difference) is as
    likely. Exact (all ``2^n`` flips) up to 13 pairs, from 9,999 random flips beyond (scipy)."""
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if len(first) == 1:  # scipy wants two pairs; one pair's two flips: itself, and its opposite
        return 0.5 if first[0] > second[0] else 1.0
    result = permutation_test(
        (first, second),
        _mean_difference,
        permutation_type="samples",
        vectorized=True,
        alternative="greater",
        rng=np.random.default_rng(seed),
    )
    return float(result.pvalue)


def fewest_pairs_for(level: float = DEFAULT_LEVEL) -> int:
    """The fewest pairs whose sign-flip test can be significant one-sided at ``(1 - level) / 2`` (6 at 95%):
    with fewer, even every pair improving is as likely as that by chance."""
    return math.ceil(math.log2(2 / (1 - level)))
