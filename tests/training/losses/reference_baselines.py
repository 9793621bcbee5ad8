"""Plain-loop references for the baseline losses, written straight from the papers' equations.

Python floats and explicit loops over samples, pairs and triplets; no vectorisation. Each function
takes ``embeddings`` (list of vectors, already L2-normalised by the caller when the loss normalises)
and ``labels`` (list of ints) and returns the loss as a float.

- contrastive: Hadsell, Chopra & LeCun 2006, Eq. 4 (power 2, with its 1/2) / pml's hinge (power 1).
- triplet: Schroff et al. 2015 / LoOp Eq. 14, mean over all valid (a, p, n).
- hphn: Hermans et al. 2017 ("batch hard"), mean over anchors with a positive and a negative.
- lifted: Song et al. 2016, Eq. 4 (smooth lifted structure), 1/(2|P|) sum of squared hinges.
- ms: Wang et al. 2019, Sec. 4 / LoOp Sec. 3.3.4: pair mining with epsilon, then the MS loss.
"""

from __future__ import annotations

import math


def normalize(embeddings: list[list[float]]) -> list[list[float]]:
    out = []
    for v in embeddings:
        norm = math.sqrt(sum(c * c for c in v))
        out.append([c / max(norm, 1e-12) for c in v])
    return out


def _distance(a: list[float], b: list[float]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def contrastive_reference(
    embeddings: list[list[float]], labels: list[int], pos_margin: float, neg_margin: float, power: float
) -> float:
    pull, push = [], []
    for i in range(len(labels)):
        for j in range(len(labels)):
            if i == j:
                continue
            d = _distance(embeddings[i], embeddings[j])
            if labels[i] == labels[j]:
                pull.append(max(0.0, d - pos_margin) ** power / power)
            else:
                push.append(max(0.0, neg_margin - d) ** power / power)
    pull_mean = sum(pull) / len(pull) if pull else 0.0
    push_mean = sum(push) / len(push) if push else 0.0
    return pull_mean + push_mean


def triplet_reference(embeddings: list[list[float]], labels: list[int], margin: float) -> float:
    total, count = 0.0, 0
    for a in range(len(labels)):
        for p in range(len(labels)):
            if p == a or labels[p] != labels[a]:
                continue
            for n in range(len(labels)):
                if labels[n] == labels[a]:
                    continue
                d_ap = _distance(embeddings[a], embeddings[p])
                d_an = _distance(embeddings[a], embeddings[n])
                total += max(0.0, d_ap - d_an + margin)
                count += 1
    return total / count if count else 0.0


def hphn_reference(embeddings: list[list[float]], labels: list[int], margin: float) -> float:
    terms = []
    for a in range(len(labels)):
        hardest_pos, hardest_neg = None, None
        for k in range(len(labels)):
            if k == a:
                continue
            d = _distance(embeddings[a], embeddings[k])
            if labels[k] == labels[a]:
                hardest_pos = d if hardest_pos is None else max(hardest_pos, d)
            else:
                hardest_neg = d if hardest_neg is None else min(hardest_neg, d)
        if hardest_pos is not None and hardest_neg is not None:
            terms.append(max(0.0, hardest_pos - hardest_neg + margin))
    return sum(terms) / len(terms) if terms else 0.0


def lifted_reference(
    embeddings: list[list[float]], labels: list[int], pos_margin: float, neg_margin: float
) -> float:
    """Song et al. Eq. 4: J_ij = log(sum_{(i,k) in N} e^{a - D_ik} + sum_{(j,l) in N} e^{a - D_jl}) + D_ij."""
    n = len(labels)
    squared_hinges = []
    for i in range(n):
        for j in range(n):
            if i == j or labels[i] != labels[j]:
                continue
            negative_sum = 0.0
            for k in range(n):
                if labels[k] != labels[i]:
                    negative_sum += math.exp(neg_margin - _distance(embeddings[i], embeddings[k]))
            for ell in range(n):
                if labels[ell] != labels[j]:
                    negative_sum += math.exp(neg_margin - _distance(embeddings[j], embeddings[ell]))
            if negative_sum == 0.0:
                continue
            j_ij = math.log(negative_sum) + _distance(embeddings[i], embeddings[j]) - pos_margin
            squared_hinges.append(max(0.0, j_ij) ** 2)
    return sum(squared_hinges) / (2 * len(squared_hinges)) if squared_hinges else 0.0


def ms_reference(
    embeddings: list[list[float]],
    labels: list[int],
    alpha: float,
    beta: float,
    base: float,
    epsilon: float,
) -> float:
    n = len(labels)
    sim = [[_dot(embeddings[i], embeddings[j]) for j in range(n)] for i in range(n)]
    total = 0.0
    for i in range(n):
        positives = [j for j in range(n) if j != i and labels[j] == labels[i]]
        negatives = [k for k in range(n) if labels[k] != labels[i]]
        pos_sum, neg_sum = 0.0, 0.0
        if positives and negatives:
            least_similar_pos = min(sim[i][j] for j in positives)
            most_similar_neg = max(sim[i][k] for k in negatives)
            for j in positives:  # keep a positive less similar than the hardest negative + eps
                if sim[i][j] - epsilon < most_similar_neg:
                    pos_sum += math.exp(-alpha * (sim[i][j] - base))
            for k in negatives:  # keep a negative more similar than the hardest positive - eps
                if sim[i][k] + epsilon > least_similar_pos:
                    neg_sum += math.exp(beta * (sim[i][k] - base))
        total += math.log(1.0 + pos_sum) / alpha + math.log(1.0 + neg_sum) / beta
    return total / n
