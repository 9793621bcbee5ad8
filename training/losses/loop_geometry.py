"""Closed-form optimal hard negatives of LoOp: the minimum distance between two same-class curves.

Vasudeva, Deora, Bhattacharya, Pal & Chanda, "LoOp: Looking for Optimal Hard Negative Embeddings for
Deep Metric Learning", ICCV 2021 (main paper Sec. 3.1-3.4 and 4.2, supplementary Sec. 4).

Given a pair ``(x1, x2)`` of one class and a pair ``(y1, y2)`` of another, LoOp looks for the points
``p1`` on the curve joining ``x1, x2`` and ``p2`` on the curve joining ``y1, y2`` that are closest, and
uses ``d(p1, p2)`` as the negative distance of the pair of pairs. Two curves are supported:

* ``"arc"``: the geodesic arcs of the unit hypersphere (l2-normalised embeddings, Sec. 3.1-3.2).
  ``p1 = n1 cos(alpha) + n2 sin(alpha)`` with the Gram-Schmidt basis ``n1 = x1``,
  ``n2 ~ x2 - (x1.x2) x1`` (Eqs. 2-3), ``alpha in [0, alpha0]``, ``alpha0 = acos(x1.x2)``; likewise
  ``p2 = n3 cos(beta) + n4 sin(beta)`` (Eq. 4). Minimising ``f = -p1.p2`` (Eq. 5) under the four box
  constraints (Eqs. 6-7) has nine KKT cases (Table 1, Fig. 2, supplementary Sec. 4.1): case 0 both
  points inside their arcs, cases 1-4 one point at an end of its arc (``alpha = 0``, ``alpha =
  alpha0``, ``beta = 0``, ``beta = beta0``), cases 5-8 both at ends (``(0, 0)``, ``(0, beta0)``,
  ``(alpha0, 0)``, ``(alpha0, beta0)``). ``d = sqrt(2 (1 - p1.p2))`` (Eq. 1).
* ``"segment"``: the straight segments for embeddings that are not normalised (Sec. 4.2, Eq. 17):
  ``p1 = (1 - k1) x1 + k1 x2``, ``p2 = (1 - k2) y1 + k2 y2``, ``k1, k2 in [0, 1]`` (Eq. 18), the same
  nine KKT cases with the solutions of Eq. 21 and supplementary Sec. 4.2 (Eqs. 23-24).

How the cases are solved. Every KKT point is a feasible point, and the minimum is one of them, so the
minimum is the best *feasible* candidate among: the interior stationary point (case 0), the stationary
point of each edge (cases 1-4) and the four corners (cases 5-8). For the arcs ``p1.p2 = u^T M v`` with
``u = (cos alpha, sin alpha)``, ``v = (cos beta, sin beta)`` and ``M = [n1 n2]^T [n3 n4]`` (the paper's
``a, b, c, d`` are ``-M22, -M12, -M21, -M11``); along an edge it is ``A cos t + B sin t``, whose
maximum is at ``t = atan2(B, A)`` (Table 1, rows 1-4: ``tan^-1(b/d)`` etc. with the ``+pi`` branch of
the supplementary chosen by atan2); inside, the only local maximum of a bilinear form on the torus is
the top singular pair of ``M``, i.e. the root of the paper's quadratic in ``tan alpha`` (Sec. 3.2,
``A = a^2 - b^2 + c^2 - d^2``), taken here as the half-angle ``atan2`` of the symmetric 2x2
eigenproblem, which has no ``ab + cd = 0`` singularity. A candidate counts only when it lies strictly
inside its range; the paper's multiplier-sign test (Eq. 12) is then implied by taking the best one.

Everything is computed from the pairwise squared distances of the four endpoints (for unit vectors,
``x.y = 1 - |x - y|^2 / 2``, the paper's ``s_ij = 1 - d_ij^2 / 2``), so a whole batch costs one
(B, B) matrix plus O(B^2) scalar work (Algorithm 1, all pairs of pairs in parallel).

Gradients. The case and the optimal ``alpha, beta`` (or ``k1, k2``) are chosen without gradient; the
distance is then re-evaluated differentiably at those parameters. This is exact (envelope theorem):
a free parameter is stationary, so its own derivative does not contribute, and a parameter at the end
of its range is written as that endpoint itself (``p1 = x2`` when ``alpha = alpha0``), so the moving
endpoint is differentiated. Degenerate input stays finite in value and gradient: an arc whose ends
coincide or are antipodal (``1 - (x1.x2)^2`` below ``16 eps`` of the dtype, e.g. about ``1.4e-3`` rad in
float32) has no usable Gram-Schmidt direction and is treated as its two endpoints (the antipodal
geodesic is not unique anyway); a zero distance is clamped before the square root.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

Geometry = Literal["arc", "segment"]

# Table 1 cases in which a point sits at the far end of its curve.
_X_AT_END = (2, 7, 8)  # alpha = alpha0 (p1 = x2), or k1 = 1
_Y_AT_END = (4, 6, 8)  # beta = beta0 (p2 = y2), or k2 = 1
_DIST_EPS = 1e-12  # clamp before sqrt, as pairs.pairwise_distances does


class OptimalNegatives(NamedTuple):
    """The optimum for each pair of pairs (all tensors share the broadcast shape of the inputs).

    ``distance``: ``d(p1, p2)``, differentiable. ``case``: the KKT case 0-8 of Table 1 / Fig. 2
    (int64). ``alpha``, ``beta``: where ``p1`` and ``p2`` lie, detached: angles from ``x1`` and ``y1``
    (``alpha in [0, alpha0]``) for arcs, the interpolation weights ``k1, k2 in [0, 1]`` for segments.
    """

    distance: torch.Tensor
    case: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor


class _Endpoints(NamedTuple):
    """Cosines (arcs) or squared distances (segments) among ``x1, x2`` (one class) and ``y1, y2``."""

    x12: torch.Tensor
    y12: torch.Tensor
    x1y1: torch.Tensor
    x1y2: torch.Tensor
    x2y1: torch.Tensor
    x2y2: torch.Tensor


class _Arc(NamedTuple):
    """An arc's ``cos(t0)``, ``sin(t0)`` (clamped away from 0) and whether it has a Gram-Schmidt direction."""

    cos: torch.Tensor
    sin: torch.Tensor
    ok: torch.Tensor


class _PointOnArc(NamedTuple):
    """Closest point of an arc to a unit point: similarity (``-inf`` unless strictly inside the arc) and
    the (unnormalised) direction ``(point . n, point . n')`` of that point in the arc's basis (Eq. 3)."""

    sim: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def pair_of_pair_distances(squared: torch.Tensor, geometry: Geometry = "arc") -> OptimalNegatives:
    """LoOp distances between all pairs of consecutive-row pairs of a batch (Algorithm 1, lines 4-6).

    ``squared`` is the (B, B) matrix of squared Euclidean distances of a batch whose rows ``(0, 1)``,
    ``(2, 3)``, ... form the pairs (B even; for ``"arc"`` the rows must be unit vectors). Returns
    (B/2, B/2) tensors whose ``[p, q]`` entry is the optimum between the curve through rows
    ``2p, 2p+1`` and the curve through rows ``2q, 2q+1`` (symmetric up to rounding; the diagonal is 0).
    Entries for two pairs of the same class are computed too and left for the caller to mask.
    """
    if squared.ndim != 2 or squared.shape[0] != squared.shape[1] or squared.shape[0] % 2:
        raise ValueError(f"expected a square (B, B) matrix with B even, got {tuple(squared.shape)}")
    if geometry == "segment":
        return _segment_solution(_blocks(squared))
    if geometry != "arc":
        raise ValueError(f"unknown geometry {geometry!r}; choose 'arc' or 'segment'")
    cosines = 1 - squared / 2  # unit vectors: x.y = 1 - |x - y|^2 / 2 (Sec. 3.3, s_ij = 1 - d_ij^2 / 2)
    ends = _blocks(cosines)
    with torch.no_grad():
        arcs = _arc(ends.x12.squeeze(1))
        # Every sample against every pair's arc at once (B, B/2); cases 1-4 of all pairs of pairs are
        # four (transposed) row-slices of this table: x1, x2 against arc y (rows 2p, 2p+1, column q)
        # and y1, y2 against arc x (rows 2q, 2q+1, column p).
        table = _point_on_arc(cosines[:, 0::2], cosines[:, 1::2], _Arc(*(t.unsqueeze(0) for t in arcs)))
        edges = [_PointOnArc(*(t[0::2] for t in table)), _PointOnArc(*(t[1::2] for t in table))]
        edges += [_PointOnArc(*(t.T for t in e)) for e in edges]
        x_arc, y_arc = _Arc(*(t.unsqueeze(1) for t in arcs)), _Arc(*(t.unsqueeze(0) for t in arcs))
    return _arc_solution(ends, x_arc, y_arc, edges)


def curve_distances(
    x1: torch.Tensor, x2: torch.Tensor, y1: torch.Tensor, y2: torch.Tensor, geometry: Geometry = "arc"
) -> OptimalNegatives:
    """LoOp distance between the curve ``x1 x2`` and the curve ``y1 y2``, elementwise over ``(..., d)``.

    For ``"arc"`` the inputs must be unit vectors (the geodesic between them is the curve).
    """

    def sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).square().sum(-1)

    ends = _Endpoints(sq(x1, x2), sq(y1, y2), sq(x1, y1), sq(x1, y2), sq(x2, y1), sq(x2, y2))
    if geometry == "segment":
        return _segment_solution(ends)
    if geometry != "arc":
        raise ValueError(f"unknown geometry {geometry!r}; choose 'arc' or 'segment'")
    ends = _Endpoints(*(1 - t / 2 for t in ends))
    with torch.no_grad():
        x_arc, y_arc = _arc(ends.x12), _arc(ends.y12)
        edges = [
            _point_on_arc(ends.x1y1, ends.x1y2, y_arc),  # case 1: x1 against arc y
            _point_on_arc(ends.x2y1, ends.x2y2, y_arc),  # case 2: x2 against arc y
            _point_on_arc(ends.x1y1, ends.x2y1, x_arc),  # case 3: y1 against arc x
            _point_on_arc(ends.x1y2, ends.x2y2, x_arc),  # case 4: y2 against arc x
        ]
    return _arc_solution(ends, x_arc, y_arc, edges)


def _blocks(matrix: torch.Tensor) -> _Endpoints:
    """The six (B/2, B/2) views of a (B, B) pair matrix: row pair ``p`` is (x1, x2), column pair ``q`` (y1, y2)."""
    x1y2 = matrix[0::2, 1::2]
    within = x1y2.diagonal()  # between the two members of each pair
    return _Endpoints(
        within.unsqueeze(1),
        within.unsqueeze(0),
        matrix[0::2, 0::2],
        x1y2,
        matrix[1::2, 0::2],
        matrix[1::2, 1::2],
    )


def _arc(cos_within: torch.Tensor) -> _Arc:
    tol = 16 * torch.finfo(cos_within.dtype).eps
    sin_sq = 1 - cos_within.square()
    return _Arc(cos_within, sin_sq.clamp_min(tol).sqrt(), sin_sq > tol)


def _point_on_arc(cos_first: torch.Tensor, cos_second: torch.Tensor, arc: _Arc) -> _PointOnArc:
    """Table 1 rows 1-4: a point fixed, the other on arc ``e1 e2`` maximising ``A cos t + B sin t``.

    ``A = point . n1 = point . e1``, ``B = point . n2 = (point . e2 - cos(t0) point . e1) / sin(t0)``
    (Eq. 2); the maximum is at the direction ``(A, B)`` (``t = atan2(B, A)``, the paper's ``tan^-1``
    with its ``+pi`` branch) with value ``hypot(A, B)``. It counts only strictly inside ``(0, t0)``.
    """
    along = (cos_second - arc.cos * cos_first) / arc.sin
    inside = arc.ok & _in_arc(cos_first, along, arc)
    return _PointOnArc(torch.hypot(cos_first, along).masked_fill(~inside, -math.inf), cos_first, along)


def _in_arc(cos_t: torch.Tensor, sin_t: torch.Tensor, arc: _Arc) -> torch.Tensor:
    """Whether the direction ``(cos_t, sin_t)`` (any positive scale) has an angle strictly in ``(0, t0)``.

    With ``t0 in (0, pi]``: the angle is in ``(0, pi)`` iff ``sin_t > 0``, and then below ``t0`` iff the
    direction turns counter-clockwise onto ``(cos t0, sin t0)``, i.e. their cross product is positive.
    """
    return (sin_t > 0) & (cos_t * arc.sin - sin_t * arc.cos > 0)


def _unit(cos_t: torch.Tensor, sin_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_t, sin_t) / |(cos_t, sin_t)|``; a zero vector stays zero."""
    norm = torch.hypot(cos_t, sin_t).clamp_min(torch.finfo(cos_t.dtype).tiny)
    return cos_t / norm, sin_t / norm


def _best_candidate(
    score: list[torch.Tensor], *params: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per pair of pairs, the case (list index) with the highest score and its parameters.

    Each argument lists one tensor per KKT case 0-8 (broadcastable); ties go to the lowest case.
    """
    case = torch.stack(torch.broadcast_tensors(*score)).max(0).indices  # (argmax over dim 0 is ~20x slower)
    pick = case.unsqueeze(0)
    return case, [torch.stack([t.expand(case.shape) for t in p]).gather(0, pick).squeeze(0) for p in params]


def _arc_kkt(
    cos: _Endpoints, x_arc: _Arc, y_arc: _Arc, edges: list[_PointOnArc]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Best of the nine KKT candidates of Table 1 for two arcs. No gradient.

    ``edges`` are cases 1-4 (:func:`_point_on_arc`). Returns the case and the unit directions
    ``(cos alpha, sin alpha, cos beta, sin beta)`` of the optimum: the points only need these (Eqs.
    3-4), so no angle is computed.
    """
    # Inner products of the bases n1, n2 (of x1, x2) and n3, n4 (of y1, y2), Eq. 2: M_rc = n_r . n_c.
    # The paper's a, b, c, d (Eq. 5) are -M24, -M14, -M23, -M13.
    m13, m14, m23 = edges[0].cos, edges[0].sin, edges[2].sin
    m24 = (edges[1].sin - x_arc.cos * m14) / x_arc.sin

    # Case 0: the top singular pair of M (the paper's quadratic in tan(alpha), Sec. 3.2, whose roots are
    # the two singular directions). u is the top eigenvector of M M^T = [[p, r], [r, q]], from whichever
    # row of M M^T - lambda I is better conditioned, turned into the upper half-plane (alpha0 <= pi);
    # v = M^T u and p1.p2 = |v| / |u| = sigma_max, the largest p1.p2 anywhere on the two great circles.
    half_diff = (m13.square() + m14.square() - m23.square() - m24.square()) / 2  # (p - q) / 2
    r = m13 * m23 + m14 * m24
    half_gap = torch.hypot(half_diff, r)  # (lambda_max - lambda_min) / 2
    wide = half_diff >= 0
    u_cos = torch.where(wide, torch.copysign(half_diff + half_gap, r), r)
    u_sin = torch.where(wide, r.abs(), half_gap - half_diff)
    v_cos, v_sin = m13 * u_cos + m23 * u_sin, m14 * u_cos + m24 * u_sin
    inner = torch.hypot(v_cos, v_sin) / torch.hypot(u_cos, u_sin)
    inside = x_arc.ok & y_arc.ok & _in_arc(u_cos, u_sin, x_arc) & _in_arc(v_cos, v_sin, y_arc)

    one, zero = torch.ones_like(m13), torch.zeros_like(m13)
    xc, xs, yc, ys = x_arc.cos, x_arc.sin, y_arc.cos, y_arc.sin
    e1, e2, e3, e4 = edges
    #         case: 0      1       2       3       4       5     6     7     8   (Table 1; 5-8: corners)
    cos_a = [u_cos, one, xc, e3.cos, e4.cos, one, one, xc, xc]
    sin_a = [u_sin, zero, xs, e3.sin, e4.sin, zero, zero, xs, xs]
    cos_b = [v_cos, e1.cos, e2.cos, one, yc, one, yc, one, yc]
    sin_b = [v_sin, e1.sin, e2.sin, zero, ys, zero, ys, zero, ys]
    score = [inner.masked_fill(~inside, -math.inf), e1.sim, e2.sim, e3.sim, e4.sim]
    case, (cos_a, sin_a, cos_b, sin_b) = _best_candidate(
        [*score, cos.x1y1, cos.x1y2, cos.x2y1, cos.x2y2], cos_a, sin_a, cos_b, sin_b
    )
    return case, [*_unit(cos_a, sin_a), *_unit(cos_b, sin_b)]


def _arc_solution(cos: _Endpoints, x_arc: _Arc, y_arc: _Arc, edges: list[_PointOnArc]) -> OptimalNegatives:
    with torch.no_grad():
        case, (cos_a, sin_a, cos_b, sin_b) = _arc_kkt(cos, x_arc, y_arc, edges)
        x_end, y_end = _at_far_end(case)
    wx1, wx2 = _arc_weights(cos.x12, cos_a, sin_a, x_end)
    wy1, wy2 = _arc_weights(cos.y12, cos_b, sin_b, y_end)
    sim = wx1 * (wy1 * cos.x1y1 + wy2 * cos.x1y2) + wx2 * (wy1 * cos.x2y1 + wy2 * cos.x2y2)
    distance = (2 - 2 * sim).clamp_min(_DIST_EPS).sqrt()  # Eq. 1
    return OptimalNegatives(distance, case, torch.atan2(sin_a, cos_a), torch.atan2(sin_b, cos_b))


def _at_far_end(case: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether ``p1`` is ``x2`` (cases 2, 7, 8) and whether ``p2`` is ``y2`` (cases 4, 6, 8)."""
    table = torch.tensor([[c in (2, 7, 8), c in (4, 6, 8)] for c in range(9)], device=case.device)
    ends = table[case]
    return ends[..., 0], ends[..., 1]


def _arc_weights(
    cos_within: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, at_end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1, w2)`` with ``p = w1 e1 + w2 e2`` at angle ``t`` from ``e1`` on the arc ``e1 e2`` (Eq. 3).

    ``p = n1 cos t + n2 sin t`` with ``n2 = (e2 - c e1) / s`` gives ``w1 = cos t - c sin t / s`` and
    ``w2 = sin t / s``, differentiable in ``c = e1.e2`` at fixed ``t``. At the far end (``t = t0``) the
    point is ``e2`` itself, so that the moving endpoint is differentiated; ``t = 0`` gives ``(1, 0)``.
    """
    tol = 16 * torch.finfo(cos_within.dtype).eps
    inv_sin = (1 - cos_within.square()).clamp_min(tol).rsqrt()  # only t > 0 (a usable arc) uses 1/s
    ratio = sin_t * inv_sin
    return torch.where(at_end, 0.0, cos_t - cos_within * ratio), torch.where(at_end, 1.0, ratio)


def _segment_solution(sq: _Endpoints) -> OptimalNegatives:
    with torch.no_grad():
        case, (k1, k2) = _segment_kkt(sq)
    # |sum_a w_a x_a - sum_b v_b y_b|^2 = sum_ab w_a v_b |x_a - y_b|^2 - w1 w2 |x1 - x2|^2 - v1 v2 |y1 - y2|^2
    # for weights summing to one (Eq. 17); at a corner it is exactly an endpoint distance.
    wx1, wx2, wy1, wy2 = 1 - k1, k1, 1 - k2, k2
    squared = (
        wx1 * (wy1 * sq.x1y1 + wy2 * sq.x1y2)
        + wx2 * (wy1 * sq.x2y1 + wy2 * sq.x2y2)
        - wx1 * wx2 * sq.x12
        - wy1 * wy2 * sq.y12
    )
    return OptimalNegatives(squared.clamp_min(_DIST_EPS).sqrt(), case, k1, k2)


def _segment_kkt(sq: _Endpoints) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Best of the nine KKT candidates for two segments (supplementary Sec. 4.2). No gradient.

    ``f(k1, k2) = |k1 u - k2 v - w|^2`` with ``u = x1 - x2``, ``v = y1 - y2``, ``w = x1 - y1`` (written
    as ``|w - k1 u + k2 v|^2``); the dot products come from the squared distances by polarisation.
    Returns the case and ``[k1, k2]``.
    """
    uu, vv, ww = sq.x12, sq.y12, sq.x1y1
    uv = (sq.x1y2 + sq.x2y1 - sq.x1y1 - sq.x2y2) / 2
    uw = (sq.x1y1 + sq.x12 - sq.x2y1) / 2
    vw = (sq.x1y2 - sq.x1y1 - sq.y12) / 2
    one, zero = torch.ones_like(ww), torch.zeros_like(ww)

    def safe(den: torch.Tensor) -> torch.Tensor:  # a zero-length segment has no stationary point
        return torch.where(den > 0, den, 1.0)

    def in_unit(t: torch.Tensor) -> torch.Tensor:
        return (t > 0) & (t < 1)

    det = uu * vv - uv.square()
    #     case 0 (Eq. 21)                  1: k1 = 0 (Eq. 23)  2: k1 = 1 (Eq. 24)  3: k2 = 0   4: k2 = 1
    k1 = [(uw * vv - uv * vw) / safe(det), zero, one, uw / safe(uu), (uw + uv) / safe(uu)]
    k2 = [(uv * uw - uu * vw) / safe(det), -vw / safe(vv), (uv - vw) / safe(vv), zero, one]
    inside = [
        (det > 0) & in_unit(k1[0]) & in_unit(k2[0]),
        (vv > 0) & in_unit(k2[1]),
        (vv > 0) & in_unit(k2[2]),
        (uu > 0) & in_unit(k1[3]),
        (uu > 0) & in_unit(k1[4]),
    ]
    free = [
        (ww + a.square() * uu + b.square() * vv - 2 * a * uw + 2 * b * vw - 2 * a * b * uv).masked_fill(
            ~ok, math.inf
        )
        for a, b, ok in zip(k1, k2, inside, strict=True)
    ]
    corners = [sq.x1y1, sq.x1y2, sq.x2y1, sq.x2y2]  # cases 5-8: (0, 0), (0, 1), (1, 0), (1, 1)
    score = [-f for f in [*free, *corners]]
    return _best_candidate(score, [*k1, zero, zero, one, one], [*k2, zero, one, zero, one])
