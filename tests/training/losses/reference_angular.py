"""Plain-loop references for the Angular loss (Wang et al., ICCV 2017): Eq. 6, Eq. 8 and NL&AL (Eq. 9).

Written straight from the equations with Python floats and explicit loops; no vectorisation.
"""

from __future__ import annotations

import math

from tests.training.losses.reference_npair import npair_all_pairs_reference


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _squared_norm(a: list[float]) -> float:
    return _dot(a, a)


def _ordered_positive_pairs(labels: list[int]) -> list[tuple[int, int]]:
    return [
        (a, p) for a in range(len(labels)) for p in range(len(labels)) if a != p and labels[a] == labels[p]
    ]


def angular_npair_reference(embeddings: list[list[float]], labels: list[int], alpha_degrees: float) -> float:
    """Eq. 8: 1/N sum_{(x_a, x_p)} log[1 + sum_{y_n != y_a, y_p} exp(f_{a,p,n})],
    f_{a,p,n} = 4 tan^2(alpha) (x_a + x_p)^T x_n - 2 (1 + tan^2(alpha)) x_a^T x_p."""
    tan2 = math.tan(math.radians(alpha_degrees)) ** 2
    pairs = _ordered_positive_pairs(labels)
    total = 0.0
    for a, p in pairs:
        xa, xp = embeddings[a], embeddings[p]
        inner = 1.0
        for n in range(len(labels)):
            if labels[n] != labels[a] and labels[n] != labels[p]:
                xn = embeddings[n]
                f = 4 * tan2 * (_dot(xa, xn) + _dot(xp, xn)) - 2 * (1 + tan2) * _dot(xa, xp)
                inner += math.exp(f)
        total += math.log(inner)
    return total / len(pairs) if pairs else 0.0


def angular_triplet_reference(
    embeddings: list[list[float]], labels: list[int], alpha_degrees: float
) -> float:
    """Eq. 6 averaged over all triplets: [||x_a - x_p||^2 - 4 tan^2(alpha) ||x_n - x_c||^2]_+,
    x_c = (x_a + x_p) / 2."""
    tan2 = math.tan(math.radians(alpha_degrees)) ** 2
    total, count = 0.0, 0
    for a, p in _ordered_positive_pairs(labels):
        xa, xp = embeddings[a], embeddings[p]
        xc = [(u + v) / 2 for u, v in zip(xa, xp, strict=True)]
        ap = _squared_norm([u - v for u, v in zip(xa, xp, strict=True)])
        for n in range(len(labels)):
            if labels[n] == labels[a]:
                continue
            nc = _squared_norm([u - v for u, v in zip(embeddings[n], xc, strict=True)])
            total += max(ap - 4 * tan2 * nc, 0.0)
            count += 1
    return total / count if count else 0.0


def npair_angular_reference(
    embeddings: list[list[float]], labels: list[int], alpha_degrees: float, lam: float
) -> float:
    """Eq. 9: l_npair(B) (Eq. 10) + lambda l_ang(B) (Eq. 8)."""
    return npair_all_pairs_reference(embeddings, labels) + lam * angular_npair_reference(
        embeddings, labels, alpha_degrees
    )
