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

How the cases are solved. Every KKT point is a feasible point and the minimum is one of them, so the
minimum is the best *feasible* candidate among the interior stationary point (case 0), the stationary
point of each edge (cases 1-4) and the four corners (cases 5-8); a candidate counts only when it lies
strictly inside its range, and the paper's multiplier-sign test (Eq. 12) is then implied by taking the
best one. For the arcs ``p1.p2 = u^T M v`` with ``u = (cos alpha, sin alpha)``, ``v = (cos beta,
sin beta)`` and ``M = [n1 n2]^T [n3 n4]`` (the paper's ``a, b, c, d`` are ``-M24, -M14, -M23, -M13``).
Along an edge this is ``A cos t + B sin t``, largest at the direction ``(A, B)``: Table 1 rows 1-4,
``tan^-1(b / d)`` etc. with the supplementary's ``+pi`` branch. Inside, the only local maximum of a
bilinear form on the torus is the top singular pair of ``M``, whose direction is a root of the
paper's quadratic in ``tan(alpha)`` (Sec. 3.2, ``A = a^2 - b^2 + c^2 - d^2``); it is taken from the
2x2 eigenproblem of ``M M^T`` directly, which has no ``ab + cd = 0`` singularity. Only the directions
``(cos, sin)`` of the optimal points are needed (Eqs. 3-4), so no trigonometric function is evaluated
except to report the angles.

Everything is computed from the pairwise squared distances of the four endpoints (for unit vectors
``x.y = 1 - |x - y|^2 / 2``, the paper's ``s_ij = 1 - d_ij^2 / 2``), so a whole batch costs one (B, B)
matrix plus O(B^2) scalar work (Algorithm 1, all pairs of pairs in parallel).

Gradients. The case and the optimal points are chosen without gradient, as fixed weights of the
endpoints (:class:`_Weights`: ``p1 = normalise(wx1 x1 + wx2 x2)`` on arcs, ``wx1 x1 + wx2 x2`` on
segments); the distance is then evaluated at those weights. This is the exact gradient of the
minimum (envelope theorem): the weights parametrise each curve over a fixed range, a free optimum is
stationary in them, and a point at an end is that endpoint itself. The derivative is written out in
:func:`_distance_forward` / :func:`_distance_backward` (one autograd node instead of dozens).
Degenerate input stays finite in value and gradient: an arc whose ends coincide or are antipodal
(``1 - (x1.x2)^2`` below ``16 eps`` of the dtype, about ``1.4e-3`` rad in float32) has no usable
Gram-Schmidt direction and is treated as its two endpoints (the antipodal geodesic is not unique
anyway); a zero-length segment likewise; a zero distance is clamped before the square root.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch
from torch.autograd.function import once_differentiable

Geometry = Literal["arc", "segment"]

_DIST_EPS = 1e-12  # clamp before sqrt, as pairs.pairwise_distances does

# Per KKT case of Table 1 (columns), where each optimal point comes from (rows: p1, p2), as an index
# into its candidates [inside (case 0), against the other curve's first end, against its second end,
# the first end, the second end]: p1 is x1 in cases 1, 5, 6 and x2 in cases 2, 7, 8; p2 is y1 in cases
# 3, 5, 7 and y2 in cases 4, 6, 8.
_SOURCE = torch.tensor([[0, 3, 4, 1, 2, 3, 3, 4, 4], [0, 1, 2, 3, 4, 3, 4, 3, 4]])
_SECOND_END = 4


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
    """Cosines (arcs) or squared distances among ``x1, x2`` (one class) and ``y1, y2`` (another)."""

    x12: torch.Tensor
    y12: torch.Tensor
    x1y1: torch.Tensor
    x1y2: torch.Tensor
    x2y1: torch.Tensor
    x2y2: torch.Tensor


class _Arc(NamedTuple):
    """An arc ``e1 e2``: ``cos t0 = e1.e2``, ``sin t0`` (clamped away from 0), and the direction
    ``(lim_cos, lim_sin)`` that bounds its inside: ``(cos t0, sin t0)``, or ``(1, 0)`` (an empty inside)
    when the arc has no Gram-Schmidt direction (coincident or antipodal ends)."""

    cos: torch.Tensor
    sin: torch.Tensor
    lim_cos: torch.Tensor
    lim_sin: torch.Tensor


class _PointOnArc(NamedTuple):
    """Closest point of an arc to a fixed unit point (Table 1 rows 1-4): ``score`` its similarity, or
    ``-inf`` unless it lies strictly inside the arc; ``cos``, ``sin`` its unnormalised direction
    ``(point . n, point . n')`` in the arc's basis (Eq. 3)."""

    score: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class _Weights(NamedTuple):
    """The optimal points as fixed combinations of the endpoints (all detached): ``p1 = wx1 x1 + wx2 x2``
    and ``p2 = wy1 y1 + wy2 y2``, normalised to the sphere for arcs. Every point of an arc is such a
    normalised non-negative combination (``w1 = sin(t0 - t) / sin t0``, ``w2 = sin t / sin t0``, Eq. 3),
    every point of a segment an affine one (Eq. 17); an end is ``(1, 0)`` or ``(0, 1)`` exactly."""

    wx1: torch.Tensor
    wx2: torch.Tensor
    wy1: torch.Tensor
    wy2: torch.Tensor


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
    with torch.no_grad():
        if geometry == "segment":
            case, weights, alpha, beta = _segment_kkt(_blocks(squared))
        elif geometry == "arc":
            case, weights, alpha, beta = _arc_kkt_batch(1 - squared / 2)
        else:
            raise ValueError(f"unknown geometry {geometry!r}; choose 'arc' or 'segment'")
    return OptimalNegatives(_PairMatrixDistance.apply(squared, weights, geometry == "arc"), case, alpha, beta)


def curve_distances(
    x1: torch.Tensor, x2: torch.Tensor, y1: torch.Tensor, y2: torch.Tensor, geometry: Geometry = "arc"
) -> OptimalNegatives:
    """LoOp distance between the curve ``x1 x2`` and the curve ``y1 y2``, elementwise over ``(..., d)``.

    For ``"arc"`` the inputs must be unit vectors (the geodesic between them is the curve).
    """

    def sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a - b).square().sum(-1)

    ends = _Endpoints(sq(x1, x2), sq(y1, y2), sq(x1, y1), sq(x1, y2), sq(x2, y1), sq(x2, y2))
    with torch.no_grad():
        if geometry == "segment":
            case, weights, alpha, beta = _segment_kkt(ends)
        elif geometry == "arc":
            cos = _Endpoints(*(1 - t / 2 for t in ends))
            x_arc, y_arc = _arc(cos.x12), _arc(cos.y12)
            # cases 1-2: x1, x2 against arc y; cases 3-4: y1, y2 against arc x
            x_ends = _point_on_arc(
                torch.stack([cos.x1y1, cos.x2y1]), torch.stack([cos.x1y2, cos.x2y2]), y_arc
            )
            y_ends = _point_on_arc(
                torch.stack([cos.x1y1, cos.x1y2]), torch.stack([cos.x2y1, cos.x2y2]), x_arc
            )
            corners = [cos.x1y1, cos.x1y2, cos.x2y1, cos.x2y2]
            case, weights, alpha, beta = _arc_kkt(x_arc, y_arc, x_ends, y_ends, corners)
        else:
            raise ValueError(f"unknown geometry {geometry!r}; choose 'arc' or 'segment'")
    return OptimalNegatives(_EndpointDistance.apply(*ends, weights, geometry == "arc"), case, alpha, beta)


def _blocks(matrix: torch.Tensor) -> _Endpoints:
    """The six (B/2, B/2)-broadcastable views of a (B, B) pair matrix: row pair ``p`` is (x1, x2),
    column pair ``q`` is (y1, y2)."""
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


# ---------------------------------------------------------------------------------------------------
# Arcs (Sec. 3.2 and supplementary Sec. 4.1): selection of the KKT case, without gradient
# ---------------------------------------------------------------------------------------------------


def _arc(cos_within: torch.Tensor) -> _Arc:
    tol = 16 * torch.finfo(cos_within.dtype).eps
    sin_sq = 1 - cos_within.square()
    usable = sin_sq > tol
    sin = sin_sq.clamp_min(tol).sqrt()
    return _Arc(cos_within, sin, torch.where(usable, cos_within, 1.0), torch.where(usable, sin, 0.0))


def _angle(arc: _Arc) -> torch.Tensor:
    return arc.cos.clamp(-1, 1).acos()


def _point_on_arc(cos_first: torch.Tensor, cos_second: torch.Tensor, arc: _Arc) -> _PointOnArc:
    """Table 1 rows 1-4: a point fixed, the other on arc ``e1 e2`` maximising ``A cos t + B sin t``.

    ``A = point . n1 = point . e1``, ``B = point . n2 = (point . e2 - cos(t0) point . e1) / sin(t0)``
    (Eq. 2); the maximum is at the direction ``(A, B)`` (``t = atan2(B, A)``, the paper's ``tan^-1``
    with its ``+pi`` branch) with value ``hypot(A, B)``. It counts only strictly inside ``(0, t0)``.
    """
    along = torch.addcmul(cos_second, arc.cos, cos_first, value=-1) / arc.sin
    score = torch.where(_in_arc(cos_first, along, arc), torch.hypot(cos_first, along), -math.inf)
    return _PointOnArc(score, cos_first, along)


def _in_arc(cos_t: torch.Tensor, sin_t: torch.Tensor, arc: _Arc) -> torch.Tensor:
    """Whether the direction ``(cos_t, sin_t)`` (any positive scale) has an angle strictly in ``(0, t0)``.

    With ``t0 in (0, pi]``: the angle is in ``(0, pi)`` iff ``sin_t > 0``, and then below ``t0`` iff the
    direction turns counter-clockwise onto ``(cos t0, sin t0)``, i.e. their cross product is positive.
    """
    return torch.minimum(sin_t, torch.addcmul(cos_t * arc.lim_sin, sin_t, arc.lim_cos, value=-1)) > 0


def _first_argmax(scores: list[torch.Tensor]) -> torch.Tensor:
    """Index of the largest of ``scores`` (one tensor per KKT case), ties to the lowest: the case.

    The first maximum is where the running maximum reaches the overall one, i.e. the number of
    running maxima below it: elementwise ops and a sum, as torch's max/argmax reductions go
    multi-threaded even on small inputs (see :func:`_sqrt`).
    """
    running = [scores[0]]
    for score in scores[1:]:
        running.append(torch.maximum(running[-1], score))
    return (torch.stack(torch.broadcast_tensors(*running[:-1])) < running[-1]).sum(0)


def _arc_kkt_batch(cosines: torch.Tensor) -> tuple[torch.Tensor, _Weights, torch.Tensor, torch.Tensor]:
    """:func:`_arc_kkt` for all pairs of pairs of a (B, B) cosine matrix."""
    pairs = len(cosines) // 2
    arc = _arc(cosines[0::2, 1::2].diagonal())
    # Every sample against every pair's arc at once, (B, B/2) viewed as [p, a, q]: member a of pair p
    # against the arc of pair q. Cases 1-2 of the pair of pairs (p, q) are x1, x2 against arc q, i.e.
    # [a, p, q]; cases 3-4 are y1, y2 of pair q against arc p, i.e. [b, q, p] transposed.
    table = [t.view(pairs, 2, pairs) for t in _point_on_arc(cosines[:, 0::2], cosines[:, 1::2], _Arc(*arc))]
    x_ends = _PointOnArc(*(t.transpose(0, 1) for t in table))
    y_ends = _PointOnArc(*(t.permute(1, 2, 0) for t in table))
    corners = [cosines[0::2, 0::2], cosines[0::2, 1::2], cosines[1::2, 0::2], cosines[1::2, 1::2]]
    x_arc, y_arc = _Arc(*(t.unsqueeze(1) for t in arc)), _Arc(*arc)
    return _arc_kkt(x_arc, y_arc, x_ends, y_ends, corners)


def _arc_kkt(
    x_arc: _Arc, y_arc: _Arc, x_ends: _PointOnArc, y_ends: _PointOnArc, corners: list[torch.Tensor]
) -> tuple[torch.Tensor, _Weights, torch.Tensor, torch.Tensor]:
    """Best of the nine KKT candidates of Table 1 for two arcs: (case, weights, alpha, beta).

    ``x_ends`` stacks cases 1-2 (:func:`_point_on_arc`: x1, x2 against arc y), ``y_ends`` cases 3-4
    (y1, y2 against arc x), ``corners`` the cosines of cases 5-8 (x1.y1, x1.y2, x2.y1, x2.y2).
    """
    # Inner products of the bases n1, n2 (of x1, x2) and n3, n4 (of y1, y2), Eq. 2: M_rc = n_r . n_c.
    m13, m14, m23 = x_ends.cos[0], x_ends.sin[0], y_ends.sin[0]
    m24 = torch.addcmul(x_ends.sin[1], x_arc.cos, m14, value=-1) / x_arc.sin

    # Case 0: u is the top eigenvector of M M^T = [[p, r], [r, q]]. Both rows of 2 (M M^T - lambda I)
    # give it, as (diff + gap, r2) and (r2, gap - diff); their sign-aligned sum never vanishes (unless
    # M M^T is a multiple of I), taken in the upper half-plane (alpha0 <= pi). v = M^T u, and
    # p1.p2 = |v| / |u| = sigma_max is the largest p1.p2 anywhere on the two great circles.
    diff = torch.addcmul(m13.square(), m14, m14) - torch.addcmul(m23.square(), m24, m24)  # p - q
    r2 = torch.addcmul(m13 * m23, m14, m24) * 2
    gap = torch.hypot(diff, r2)  # lambda_max - lambda_min
    abs_r2 = r2.abs()
    u_cos, u_sin = torch.copysign(diff + gap + abs_r2, r2), abs_r2 + (gap - diff)
    v_cos, v_sin = torch.addcmul(m13 * u_cos, m23, u_sin), torch.addcmul(m14 * u_cos, m24, u_sin)
    inside = _in_arc(u_cos, u_sin, x_arc) & _in_arc(v_cos, v_sin, y_arc)
    inner = torch.where(inside, torch.hypot(v_cos, v_sin) / torch.hypot(u_cos, u_sin), -math.inf)

    case = _first_argmax([inner, *x_ends.score, *y_ends.score, *corners])
    # Both optimal points at once, dim 0 = (p1 on arc x, p2 on arc y). Candidate directions, in the order
    # of _SOURCE: inside (case 0), the two point-against-arc cases, the first end (1, 0), the second
    # end (its direction is unused: it is the endpoint itself).
    one, zero = torch.ones_like(inner).unsqueeze(0), torch.zeros_like(inner).unsqueeze(0)
    cos_t = torch.cat([u_cos.unsqueeze(0), y_ends.cos, one, zero, v_cos.unsqueeze(0), x_ends.cos, one, zero])
    sin_t = torch.cat(
        [u_sin.unsqueeze(0), y_ends.sin, zero, zero, v_sin.unsqueeze(0), x_ends.sin, zero, zero]
    )
    table = _SOURCE.to(case.device).view(2, *[1] * case.ndim, 9).expand(2, *case.shape, 9)
    source = table.gather(-1, case.expand(2, *case.shape).unsqueeze(-1)).squeeze(-1)
    pick = source.unsqueeze(1)
    cos_t, sin_t = (t.view(2, 5, *case.shape).gather(1, pick).squeeze(1) for t in (cos_t, sin_t))
    norm = torch.hypot(cos_t, sin_t).clamp_min(torch.finfo(cos_t.dtype).tiny)
    cos_t, sin_t = cos_t / norm, sin_t / norm
    at_end = source == _SECOND_END
    # (acos on the per-arc values: vectorised transcendental ops on large tensors run multi-threaded,
    # and waking a sleeping worker thread costs more than the whole computation on a busy machine)
    arc_cos, arc_sin, end_angle = (
        torch.stack([x.expand(case.shape), y.expand(case.shape)])
        for x, y in ((x_arc.cos, y_arc.cos), (x_arc.sin, y_arc.sin), (_angle(x_arc), _angle(y_arc)))
    )

    # The point n1 cos t + n2 sin t with n2 = (e2 - c e1) / s (Eqs. 2-3) is (cos t - c sin t / s) e1
    # + (sin t / s) e2; the second end is (0, 1).
    sin_over_s = sin_t / arc_sin
    w1, w2 = torch.addcmul(cos_t, arc_cos, sin_over_s, value=-1), sin_over_s + at_end.to(sin_t.dtype)
    alpha, beta = torch.where(at_end, end_angle, torch.atan2(sin_t, cos_t))
    return case, _Weights(w1[0], w2[0], w1[1], w2[1]), alpha, beta


# ---------------------------------------------------------------------------------------------------
# Segments (Sec. 4.2 and supplementary Sec. 4.2): selection of the KKT case, without gradient
# ---------------------------------------------------------------------------------------------------


def _segment_kkt(sq: _Endpoints) -> tuple[torch.Tensor, _Weights, torch.Tensor, torch.Tensor]:
    """Best of the nine KKT candidates for two segments: (case, weights, k1, k2).

    ``f(k1, k2) = |k1 u - k2 v - w|^2`` with ``u = x1 - x2``, ``v = y1 - y2``, ``w = x1 - y1`` (written
    as ``|w - k1 u + k2 v|^2``); the dot products come from the squared distances by polarisation.
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
    #      case 0 (Eq. 21)                  1: k1 = 0 (Eq. 23)  2: k1 = 1 (Eq. 24)  3: k2 = 0   4: k2 = 1
    k1s = [(uw * vv - uv * vw) / safe(det), zero, one, uw / safe(uu), (uw + uv) / safe(uu)]
    k2s = [(uv * uw - uu * vw) / safe(det), -vw / safe(vv), (uv - vw) / safe(vv), zero, one]
    inside = [
        (det > 0) & in_unit(k1s[0]) & in_unit(k2s[0]),
        (vv > 0) & in_unit(k2s[1]),
        (vv > 0) & in_unit(k2s[2]),
        (uu > 0) & in_unit(k1s[3]),
        (uu > 0) & in_unit(k1s[4]),
    ]
    free = [
        torch.where(
            ok, ww + a.square() * uu + b.square() * vv - 2 * a * uw + 2 * b * vw - 2 * a * b * uv, math.inf
        )
        for a, b, ok in zip(k1s, k2s, inside, strict=True)
    ]
    corners = [sq.x1y1, sq.x1y2, sq.x2y1, sq.x2y2]  # cases 5-8: (0, 0), (0, 1), (1, 0), (1, 1)
    case = _first_argmax([-f for f in [*free, *corners]])
    pick = case.unsqueeze(0)
    k1, k2 = (
        torch.stack([t.expand(case.shape) for t in k]).gather(0, pick).squeeze(0)
        for k in ([*k1s, zero, zero, one, one], [*k2s, zero, one, zero, one])
    )
    return case, _Weights(1 - k1, k1, 1 - k2, k2), k1, k2


# ---------------------------------------------------------------------------------------------------
# The distance at the chosen points, with its exact gradient (both curves)
# ---------------------------------------------------------------------------------------------------


class _Forward(NamedTuple):
    """What the backward pass needs: the weights, ``d(d)/d(d^2)`` (0 where clamped) and the
    derivatives of ``d^2`` with respect to ``T = sum_ab wx_a wy_b |x_a - y_b|^2``, ``|x1 - x2|^2`` and
    ``|y1 - y2|^2``."""

    w: _Weights
    half_inverse: torch.Tensor
    by_cross: torch.Tensor
    by_x12: torch.Tensor
    by_y12: torch.Tensor


def _distance_forward(sq: _Endpoints, w: _Weights, on_sphere: bool) -> tuple[torch.Tensor, _Forward]:
    """``|p1 - p2|`` at the fixed weights ``w``, from the squared endpoint distances.

    With ``P1 = wx1 x1 + wx2 x2``, ``P2 = wy1 y1 + wy2 y2``, ``W = w1 + w2`` and
    ``T = sum_ab wx_a wy_b |x_a - y_b|^2``, for weights summing to 1 (segments, Eq. 17) or for unit
    endpoints: ``|P1 - P2|^2 = T - wx1 wx2 |x1 - x2|^2 - wy1 wy2 |y1 - y2|^2 + (Wx - Wy)^2``. Arcs take
    ``p = P / |P|``, ``|P1|^2 = Wx^2 - wx1 wx2 |x1 - x2|^2``, and
    ``|p1 - p2|^2 = (|P1 - P2|^2 - (|P1| - |P2|)^2) / (|P1| |P2|)`` (= ``2 (1 - p1.p2)``, Eq. 1). Every
    term is small when the points are close (no ``2 - 2 cos`` cancellation), and at an end (weights
    (1, 0) or (0, 1), ``|P| = 1``) this is exactly the endpoint distance.
    """
    cross = w.wx1 * (w.wy1 * sq.x1y1 + w.wy2 * sq.x1y2) + w.wx2 * (w.wy1 * sq.x2y1 + w.wy2 * sq.x2y2)
    x_pair, y_pair = w.wx1 * w.wx2, w.wy1 * w.wy2
    x_sum, y_sum = w.wx1 + w.wx2, w.wy1 + w.wy2
    squared = cross - x_pair * sq.x12 - y_pair * sq.y12 + (x_sum - y_sum).square()
    if on_sphere:
        x_norm, y_norm = _sqrt(x_sum.square() - x_pair * sq.x12), _sqrt(y_sum.square() - y_pair * sq.y12)
        inverse = 1 / (x_norm * y_norm)
        squared = (squared - (x_norm - y_norm).square()) * inverse
        # d(d^2)/d|P1| and d|P1|/d|x1 - x2|^2 = -wx1 wx2 / (2 |P1|), likewise for P2
        by_x_norm = -2 * (x_norm - y_norm) * inverse - squared / x_norm
        by_y_norm = 2 * (x_norm - y_norm) * inverse - squared / y_norm
        by_cross = inverse
        by_x12 = -x_pair * (inverse + by_x_norm / (2 * x_norm))
        by_y12 = -y_pair * (inverse + by_y_norm / (2 * y_norm))
    else:
        by_cross, by_x12, by_y12 = torch.ones_like(cross), -x_pair, -y_pair
    clamped = squared.clamp_min(_DIST_EPS)
    inverse_distance = clamped.rsqrt()
    half_inverse = torch.where(squared > _DIST_EPS, 0.5 * inverse_distance, 0.0)
    return clamped * inverse_distance, _Forward(w, half_inverse, by_cross, by_x12, by_y12)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt`` of a positive tensor as ``x * rsqrt(x)``: on CPU torch's ``sqrt`` (like ``acos``) runs
    multi-threaded from 2048 elements on, and after the long run of small single-threaded ops above,
    waking the sleeping worker thread costs up to milliseconds on a loaded machine."""
    return x * x.clamp_min(torch.finfo(x.dtype).tiny).rsqrt()


def _distance_backward(saved: _Forward, grad: torch.Tensor) -> _Endpoints:
    """Gradient of the distance with respect to the six squared distances (before broadcasting)."""
    g = grad * saved.half_inverse  # d(d)/d(d^2)
    w, g_cross = saved.w, g * saved.by_cross
    gx1, gx2 = g_cross * w.wx1, g_cross * w.wx2
    return _Endpoints(g * saved.by_x12, g * saved.by_y12, gx1 * w.wy1, gx1 * w.wy2, gx2 * w.wy1, gx2 * w.wy2)


class _EndpointDistance(torch.autograd.Function):
    """``d(p1, p2)`` from the six squared endpoint distances (any broadcastable shapes)."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> torch.Tensor:
        *ends, weights, on_sphere = inputs
        sq = _Endpoints(*ends)
        distance, ctx.saved = _distance_forward(sq, weights, on_sphere)
        ctx.shapes = [t.shape for t in sq]
        return distance

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = _distance_backward(ctx.saved, grad)
        return (*(g.sum_to_size(shape) for g, shape in zip(grads, ctx.shapes, strict=True)), None, None)


class _PairMatrixDistance(torch.autograd.Function):
    """``d(p1, p2)`` for all pairs of pairs from the (B, B) squared distance matrix (one gradient)."""

    @staticmethod
    def forward(ctx: Any, squared: torch.Tensor, weights: _Weights, on_sphere: bool) -> torch.Tensor:
        distance, ctx.saved = _distance_forward(_blocks(squared), weights, on_sphere)
        return distance

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        g = _distance_backward(ctx.saved, grad)
        x1y2 = g.x1y2.clone()
        x1y2.diagonal().add_(g.x12.sum(1) + g.y12.sum(0))  # |x_2p - x_2p+1|^2 is entry (2p, 2p+1)
        pairs = len(x1y2)
        blocks = torch.stack([g.x1y1, x1y2, g.x2y1, g.x2y2]).view(2, 2, pairs, pairs)
        return blocks.permute(2, 0, 3, 1).reshape(2 * pairs, 2 * pairs), None, None
