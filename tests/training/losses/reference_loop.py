"""Plain-Python references for LoOp (Vasudeva et al., ICCV 2021), straight from the paper's equations.

The geometry follows the paper literally: the Gram-Schmidt bases (Eq. 2), ``a, b, c, d`` (Eq. 5), the
candidate solutions of Table 1 / supplementary Sec. 4 (``tan^-1`` with the ``+pi`` branch for negative
angles, the two roots of the quadratic in ``tan(alpha)`` for case 0), the feasibility constraints
(Eqs. 6-7) and the sign of the KKT multipliers (Eq. 12); the minimum distance over the candidates
that satisfy them is returned. The segment version uses supplementary Sec. 4.2 (``a, b, c, a', b',
c'``, Eqs. 21-24). The losses loop over samples and pairs (Eqs. 14-16 and the MS mining rule).
Everything is float64 Python; inputs are sequences of floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

Vector = Sequence[float]
_TOL = 1e-10  # slack on the constraints g_i <= 0 and the multipliers lambda_i <= 0


def _dot(u: Vector, v: Vector) -> float:
    return sum(a * b for a, b in zip(u, v, strict=True))


def _combine(s: float, u: Vector, t: float, v: Vector) -> list[float]:
    return [s * a + t * b for a, b in zip(u, v, strict=True)]


def _unit(u: Vector) -> list[float]:
    norm = math.sqrt(_dot(u, u))
    return [a / norm for a in u]


def _distance(u: Vector, v: Vector) -> float:
    return math.sqrt(sum((a - b) ** 2 for a, b in zip(u, v, strict=True)))


def _atan(num: float, den: float) -> float:
    """``tan^-1(num / den)`` in [0, pi): the paper adds pi to a negative angle (supplementary Sec. 4.1)."""
    angle = math.atan(num / den) if den != 0 else math.copysign(math.pi / 2, num)
    return angle + math.pi if angle < 0 else angle


def arc_reference(x1: Vector, x2: Vector, y1: Vector, y2: Vector) -> tuple[float, int, float, float]:
    """(distance, KKT case, alpha, beta) between the geodesic arcs x1x2 and y1y2 (unit vectors)."""
    n1, n3 = list(x1), list(y1)
    n2 = _unit(_combine(1.0, x2, -_dot(x1, x2), x1))  # Eq. 2
    n4 = _unit(_combine(1.0, y2, -_dot(y1, y2), y1))
    alpha0 = math.acos(max(-1.0, min(1.0, _dot(x1, x2))))
    beta0 = math.acos(max(-1.0, min(1.0, _dot(y1, y2))))
    a, b, c, d = -_dot(n2, n4), -_dot(n1, n4), -_dot(n2, n3), -_dot(n1, n3)  # Eq. 5

    def f(al: float, be: float) -> float:  # Eq. 5: f = -p1.p2
        sa, ca, sb, cb = math.sin(al), math.cos(al), math.sin(be), math.cos(be)
        return a * sa * sb + b * ca * sb + c * sa * cb + d * ca * cb

    def f_alpha(al: float, be: float) -> float:  # df/dalpha, Eq. 9 without the multipliers
        sa, ca, sb, cb = math.sin(al), math.cos(al), math.sin(be), math.cos(be)
        return a * ca * sb - b * sa * sb + c * ca * cb - d * sa * cb

    def f_beta(al: float, be: float) -> float:  # df/dbeta, Eq. 10 without the multipliers
        sa, ca, sb, cb = math.sin(al), math.cos(al), math.sin(be), math.cos(be)
        return a * sa * cb + b * ca * cb - c * sa * sb - d * ca * sb

    def beta_given_alpha(al: float) -> float:  # df/dbeta = 0 at fixed alpha (Table 1 row 2)
        return _atan(a * math.sin(al) + b * math.cos(al), c * math.sin(al) + d * math.cos(al))

    def alpha_given_beta(be: float) -> float:  # df/dalpha = 0 at fixed beta (Table 1 row 4)
        return _atan(a * math.sin(be) + c * math.cos(be), b * math.sin(be) + d * math.cos(be))

    # (case, alpha, beta, multipliers that must be <= 0), Table 1 and supplementary Sec. 4.1
    candidates: list[tuple[int, float, float, list[float]]] = []
    big_a, ab_cd = a * a - b * b + c * c - d * d, a * b + c * d
    for sign in (1.0, -1.0):  # case 0: the two roots of the quadratic in tan(alpha)
        al = _atan(big_a + sign * math.sqrt(big_a**2 + 4 * ab_cd**2), 2 * ab_cd)
        candidates.append((0, al, beta_given_alpha(al), []))
    be = _atan(b, d)
    candidates.append((1, 0.0, be, [-f_alpha(0.0, be)]))
    be = beta_given_alpha(alpha0)
    candidates.append((2, alpha0, be, [f_alpha(alpha0, be)]))
    al = _atan(c, d)
    candidates.append((3, al, 0.0, [-f_beta(al, 0.0)]))
    al = alpha_given_beta(beta0)
    candidates.append((4, al, beta0, [f_beta(al, beta0)]))
    candidates.append((5, 0.0, 0.0, [-f_alpha(0.0, 0.0), -f_beta(0.0, 0.0)]))
    candidates.append((6, 0.0, beta0, [-f_alpha(0.0, beta0), f_beta(0.0, beta0)]))
    candidates.append((7, alpha0, 0.0, [f_alpha(alpha0, 0.0), -f_beta(alpha0, 0.0)]))
    candidates.append((8, alpha0, beta0, [f_alpha(alpha0, beta0), f_beta(alpha0, beta0)]))

    valid = [
        (f(al, be), case, al, be)
        for case, al, be, multipliers in candidates
        if -_TOL <= al <= alpha0 + _TOL
        and -_TOL <= be <= beta0 + _TOL
        and all(m <= _TOL for m in multipliers)
    ]
    value, case, al, be = min(valid)
    return math.sqrt(max(2 + 2 * value, 0.0)), case, al, be  # Eq. 1: d^2 = 2 (1 - p1.p2)


def segment_reference(x1: Vector, x2: Vector, y1: Vector, y2: Vector) -> tuple[float, int, float, float]:
    """(distance, KKT case, k1, k2) between the segments x1x2 and y1y2 (supplementary Sec. 4.2)."""
    u, v, w = _combine(1, x1, -1, x2), _combine(1, y1, -1, y2), _combine(1, x1, -1, y1)
    a, b, c = _dot(u, u), -_dot(u, v), -_dot(u, w)  # Eq. 21
    a_, b_, c_ = -_dot(v, u), _dot(v, v), _dot(v, w)  # Eq. 22

    def f(k1: float, k2: float) -> float:  # |k1 u - k2 v - w|^2
        return sum((k1 * p - k2 * q - r) ** 2 for p, q, r in zip(u, v, w, strict=True))

    def f_k1(k1: float, k2: float) -> float:  # Eq. 21 (half the derivative; the factor 2 does not matter)
        return a * k1 + b * k2 + c

    def f_k2(k1: float, k2: float) -> float:  # Eq. 22
        return a_ * k1 + b_ * k2 + c_

    candidates: list[tuple[int, float, float, list[float]]] = []
    det = a_ * b - a * b_
    if det != 0:  # case 0
        candidates.append((0, (b_ * c - b * c_) / det, (a * c_ - a_ * c) / det, []))
    if b_ != 0:
        k2 = -c_ / b_  # Eq. 23
        candidates.append((1, 0.0, k2, [-f_k1(0.0, k2)]))
        k2 = -(a_ + c_) / b_  # Eq. 24
        candidates.append((2, 1.0, k2, [f_k1(1.0, k2)]))
    if a != 0:
        k1 = -c / a
        candidates.append((3, k1, 0.0, [-f_k2(k1, 0.0)]))
        k1 = -(b + c) / a
        candidates.append((4, k1, 1.0, [f_k2(k1, 1.0)]))
    candidates.append((5, 0.0, 0.0, [-f_k1(0.0, 0.0), -f_k2(0.0, 0.0)]))
    candidates.append((6, 0.0, 1.0, [-f_k1(0.0, 1.0), f_k2(0.0, 1.0)]))
    candidates.append((7, 1.0, 0.0, [f_k1(1.0, 0.0), -f_k2(1.0, 0.0)]))
    candidates.append((8, 1.0, 1.0, [f_k1(1.0, 1.0), f_k2(1.0, 1.0)]))
    valid = [
        (f(k1, k2), case, k1, k2)
        for case, k1, k2, multipliers in candidates
        if -_TOL <= k1 <= 1 + _TOL and -_TOL <= k2 <= 1 + _TOL and all(m <= _TOL for m in multipliers)
    ]
    value, case, k1, k2 = min(valid)
    return math.sqrt(max(value, 0.0)), case, k1, k2


# ---------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------

NegativeDistance = Callable[[int, int], float]


def _prepare(
    embeddings: Sequence[Vector], labels: Sequence[int], hard_negatives: str, normalize: bool
) -> tuple[list[list[float]], Callable[[int, int], float], NegativeDistance]:
    """Embeddings (normalised or not), d(i, j), and the negative distance for anchor i and negative k:
    ``d_ik`` (endpoints) or the LoOp distance between the curves of the pairs of i and k."""
    xs = [_unit(x) if normalize else list(x) for x in embeddings]
    geometry = arc_reference if normalize else segment_reference
    assert len(xs) % 2 == 0 and all(labels[i] == labels[i + 1] for i in range(0, len(xs), 2))
    cache: dict[tuple[int, int], float] = {}

    def dist(i: int, j: int) -> float:
        return _distance(xs[i], xs[j])

    def negative(i: int, k: int) -> float:
        if hard_negatives == "endpoints":
            return dist(i, k)
        p, q = i // 2, k // 2
        if (p, q) not in cache:
            cache[(p, q)] = geometry(xs[2 * p], xs[2 * p + 1], xs[2 * q], xs[2 * q + 1])[0]
        return cache[(p, q)]

    return xs, dist, negative


def triplet_reference(
    embeddings: Sequence[Vector],
    labels: Sequence[int],
    margin: float,
    hard_negatives: str,
    normalize: bool = True,
) -> float:
    """Eq. 14 (endpoints) / Eq. 15 (loop): 1/|P| sum_{(i,j) in P} sum_{k: c[k] != c[i]} [d_ij - d_ik + m]+."""
    xs, dist, negative = _prepare(embeddings, labels, hard_negatives, normalize)
    total = 0.0
    for i in range(len(xs)):
        j = i + 1 if i % 2 == 0 else i - 1  # (i, j): an ordered pair of Algorithm 1
        for k in range(len(xs)):
            if labels[k] != labels[i]:
                total += max(0.0, dist(i, j) - negative(i, k) + margin)
    return total / len(xs)


def hardest_negative_reference(
    embeddings: Sequence[Vector],
    labels: Sequence[int],
    margin: float,
    hard_negatives: str,
    hardest_positive: bool,
    normalize: bool = True,
) -> float:
    """HPHN-triplet (Sec. 3.3.2, hardest_positive) or lifted structure (Eq. 16), one term per pair."""
    xs, dist, negative = _prepare(embeddings, labels, hard_negatives, normalize)
    terms = []
    for i in range(0, len(xs), 2):
        j = i + 1
        if hardest_positive:
            positive = max(
                max(dist(i, k) for k in range(len(xs)) if labels[k] == labels[i] and k != i),
                max(dist(j, k) for k in range(len(xs)) if labels[k] == labels[j] and k != j),
            )
        else:
            positive = dist(i, j)
        negatives = [negative(a, k) for a in (i, j) for k in range(len(xs)) if labels[k] != labels[a]]
        terms.append(max(0.0, positive + margin - min(negatives)) if negatives else 0.0)
    return sum(terms) / len(terms)


def multi_similarity_reference(
    embeddings: Sequence[Vector],
    labels: Sequence[int],
    alpha: float,
    beta: float,
    base: float,
    epsilon: float,
    hard_negatives: str,
    normalize: bool = True,
) -> float:
    """MS loss with MS mining (Sec. 3.3.4), s = 1 - d^2/2; LoOp replaces the negative similarities."""
    xs, dist, negative = _prepare(embeddings, labels, hard_negatives, normalize)
    total = 0.0
    for i in range(len(xs)):
        pos = [1 - dist(i, j) ** 2 / 2 for j in range(len(xs)) if j != i and labels[j] == labels[i]]
        neg = [1 - negative(i, k) ** 2 / 2 for k in range(len(xs)) if labels[k] != labels[i]]
        least_pos = min(pos) if pos else math.inf
        most_neg = max(neg) if neg else -math.inf
        mined_neg = [s for s in neg if s > least_pos - epsilon]
        mined_pos = [s for s in pos if s < most_neg + epsilon]
        total += math.log(1 + sum(math.exp(-alpha * (s - base)) for s in mined_pos)) / alpha
        total += math.log(1 + sum(math.exp(beta * (s - base)) for s in mined_neg)) / beta
    return total / len(xs)
