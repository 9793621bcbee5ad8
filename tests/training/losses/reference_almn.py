"""Plain-loop references for ALMN (Chen & Deng, ECCV 2018): the loss of Eq. 8 with Eq. 6-7, and Eq. 2.

Written straight from the equations with Python floats and explicit loops; no vectorisation. The
centres are given (a dict label -> centre), as the loss treats them as constants.
"""

from __future__ import annotations

import math


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _norm(a: list[float]) -> float:
    return math.sqrt(_dot(a, a))


def _angle(a: list[float], b: list[float]) -> float:
    cos = _dot(a, b) / (_norm(a) * _norm(b))
    return math.acos(max(-1.0, min(1.0, cos)))


def almn_angles(
    embeddings: list[list[float]], labels: list[int], centres: dict[int, list[float]]
) -> list[tuple[float, float]]:
    """(theta_nn, theta_i) per sample: theta_i = angle(x_i, c_{y_i}); theta_nn = smallest angle between
    c_{y_i} and a sample of another class."""
    result = []
    for i, x in enumerate(embeddings):
        c = centres[labels[i]]
        theta_nn = min(_angle(embeddings[j], c) for j in range(len(labels)) if labels[j] != labels[i])
        result.append((theta_nn, _angle(x, c)))
    return result


def almn_reference(
    embeddings: list[list[float]],
    labels: list[int],
    centres: dict[int, list[float]],
    beta: float,
    l2_reg: float,
) -> float:
    """Eq. 8 with x_g from Eq. 7, M = beta ||x_i|| sqrt(2 - 2 cos(theta*)) / ||x_i - c||, where
    theta* = theta_nn - theta_i, clamped at 0 for hard patterns (theta_nn <= theta_i)."""
    n = len(embeddings)
    angles = almn_angles(embeddings, labels, centres)
    data = 0.0
    for i, x in enumerate(embeddings):
        c = centres[labels[i]]
        theta_nn, theta_i = angles[i]
        theta_star = max(theta_nn - theta_i, 0.0)
        distance = _norm([u - v for u, v in zip(x, c, strict=True)])
        m = beta * _norm(x) * math.sqrt(2 - 2 * math.cos(theta_star)) / distance
        v = [(m + 1) * u - m * w for u, w in zip(x, c, strict=True)]  # (M + 1) x_i - M c
        x_g = [u / _norm(v) * _norm(x) for u in v]
        numerator = math.exp(_dot(x_g, c))
        denominator = numerator
        for j in range(n):
            if labels[j] != labels[i]:
                denominator += math.exp(_dot(embeddings[j], c))
        data += -math.log(numerator / denominator)
    return data / n + l2_reg / (2 * n) * sum(_dot(x, x) for x in embeddings)


def centre_update_reference(
    centres: dict[int, list[float]], embeddings: list[list[float]], labels: list[int], alpha: float
) -> dict[int, list[float]]:
    """Eq. 2: c_z <- c_z - alpha sum_i 1{y_i = z} (c_z - x_i) / (1 + sum_i 1{y_i = z}), for every z."""
    updated = {}
    for z, c in centres.items():
        count = 0
        step = [0.0] * len(c)
        for i, x in enumerate(embeddings):
            if labels[i] == z:
                count += 1
                for k in range(len(c)):
                    step[k] += c[k] - x[k]
        updated[z] = [c[k] - alpha * step[k] / (1 + count) for k in range(len(c))]
    return updated
