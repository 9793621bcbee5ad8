"""Plain-loop references for the N-pair losses.

* ALMN Eq. 1 (Sohn's multi-class N-pair loss with the L2 term), Chen & Deng 2018;
* Angular-loss paper Eq. 10 (its N-pair term of NL&AL), Wang et al. 2017.

Written straight from the equations with Python floats and explicit loops; no vectorisation.
"""

from __future__ import annotations

import math


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def sohn_tuples_reference(labels: list[int]) -> list[tuple[int, int]]:
    """Per class with at least two samples: (index of its first sample, index of its second sample)."""
    seen: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        seen.setdefault(label, []).append(i)
    return [(members[0], members[1]) for members in seen.values() if len(members) >= 2]


def npair_reference(embeddings: list[list[float]], labels: list[int], l2_reg: float) -> float:
    """ALMN Eq. 1: -1/N' sum log(e^{x_i^T x_i+} / (e^{x_i^T x_i+} + sum_j e^{x_j^T x_i+})) + l2 term.

    x_i+ is the anchor, x_i its positive, x_j the positives of the other tuples; N' is the number of
    tuples; the L2 term is lambda/(2N) sum ||x||^2 over all N embeddings of the batch.
    """
    tuples = sohn_tuples_reference(labels)
    data = 0.0
    for anchor, positive in tuples:
        numerator = math.exp(_dot(embeddings[positive], embeddings[anchor]))
        denominator = numerator
        for other_anchor, other_positive in tuples:
            if labels[other_anchor] != labels[anchor]:
                denominator += math.exp(_dot(embeddings[other_positive], embeddings[anchor]))
        data += -math.log(numerator / denominator)
    if tuples:
        data /= len(tuples)
    n = len(embeddings)
    return data + l2_reg / (2 * n) * sum(_dot(x, x) for x in embeddings)


def npair_all_pairs_reference(embeddings: list[list[float]], labels: list[int]) -> float:
    """Angular paper Eq. 10: 1/N sum_{(x_a, x_p)} log[1 + sum_{y_n != y_a} exp(x_a^T x_n - x_a^T x_p)],
    over every ordered positive pair (a, p), a != p."""
    total, pairs = 0.0, 0
    for a in range(len(labels)):
        for p in range(len(labels)):
            if p == a or labels[p] != labels[a]:
                continue
            inner = 1.0
            for n in range(len(labels)):
                if labels[n] != labels[a]:
                    inner += math.exp(_dot(embeddings[a], embeddings[n]) - _dot(embeddings[a], embeddings[p]))
            total += math.log(inner)
            pairs += 1
    return total / pairs if pairs else 0.0
