"""Plain-loop references for Magnet loss (Eq. 5) and the kNC classifier (Eq. 6), Rippel et al. 2016.

Written straight from the equations with Python floats and explicit loops; no vectorisation.
"""

from __future__ import annotations

import math


def _squared_distance(a: list[float], b: list[float]) -> float:
    return sum((x - y) ** 2 for x, y in zip(a, b, strict=True))


def _mean(rows: list[list[float]]) -> list[float]:
    return [sum(column) / len(rows) for column in zip(*rows, strict=True)]


def magnet_loss_reference(
    embeddings: list[list[float]],
    labels: list[int],
    cluster_ids: list[int] | None,
    alpha: float,
    global_scaling: float = 1.0,
) -> float:
    """Eq. 5: a cluster is the samples sharing (label, cluster id); each class is one cluster without ids.
    ``global_scaling`` s divides the variance of every Gaussian (Appendix B, Table 1)."""
    ids = labels if cluster_ids is None else cluster_ids
    keys = [(labels[i], ids[i]) for i in range(len(labels))]
    members: dict[tuple[int, int], list[list[float]]] = {}
    for key, r in zip(keys, embeddings, strict=True):
        members.setdefault(key, []).append(r)
    mu = {key: _mean(rows) for key, rows in members.items()}  # mu_m = 1/D sum_d r_d^m

    n = len(embeddings)
    variance = sum(_squared_distance(embeddings[i], mu[keys[i]]) for i in range(n)) / (n - 1)
    variance /= global_scaling

    total = 0.0
    for i in range(n):
        r, own_key = embeddings[i], keys[i]
        numerator = math.exp(-_squared_distance(r, mu[own_key]) / (2 * variance) - alpha)
        denominator = 0.0
        for key, centre in mu.items():
            if key[0] != labels[i]:  # C(mu) != C(r)
                denominator += math.exp(-_squared_distance(r, centre) / (2 * variance))
        total += max(-math.log(numerator / denominator), 0.0)
    return total / n


def knc_proba_reference(
    queries: list[list[float]],
    centres: list[list[float]],
    centre_labels: list[int],
    variance: float,
    num_nearest: int,
) -> list[list[float]]:
    """Eq. 6 probabilities over the L nearest centres; columns are the sorted distinct centre labels."""
    classes = sorted(set(centre_labels))
    probabilities = []
    for r in queries:
        by_distance = sorted(range(len(centres)), key=lambda k: _squared_distance(r, centres[k]))
        nearest = by_distance[:num_nearest]
        weight = {k: math.exp(-_squared_distance(r, centres[k]) / (2 * variance)) for k in nearest}
        total = sum(weight.values())
        row = []
        for c in classes:
            row.append(sum(weight[k] for k in nearest if centre_labels[k] == c) / total)
        probabilities.append(row)
    return probabilities
