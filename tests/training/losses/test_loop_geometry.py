"""LoOp closed-form geometry (Sec. 3.1-3.2, 4.2, Table 1): grid search, KKT cases, reference, gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.training.losses.reference_loop import arc_reference, segment_reference
from training.losses.loop_geometry import OptimalNegatives, curve_distances, pair_of_pair_distances
from training.losses.pairs import pairwise_distances

GEOMETRIES = ["arc", "segment"]


def _tuples(seed: int, count: int, dim: int, geometry: str) -> torch.Tensor:
    """(4, count, dim) float64 endpoints x1, x2, y1, y2 around a common centre, at varied spreads so
    that every KKT case occurs (unit vectors for arcs)."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.randn(1, count, dim, generator=gen, dtype=torch.float64)
    spread = torch.rand(1, count, 1, generator=gen, dtype=torch.float64) * 1.5 + 0.1
    points = centre + spread * torch.randn(4, count, dim, generator=gen, dtype=torch.float64)
    return points / points.norm(dim=-1, keepdim=True) if geometry == "arc" else points


def _curve(start: np.ndarray, end: np.ndarray, t: np.ndarray, geometry: str) -> np.ndarray:
    """Points at fractions ``t`` along the curve (``t`` of any shape; output ``t.shape + (d,)``)."""
    t = t[..., None]
    if geometry == "segment":
        return (1 - t) * start + t * end
    angle = math.acos(min(1.0, max(-1.0, float(start @ end))))  # the arc through alpha = t alpha0
    return (np.sin((1 - t) * angle) * start + np.sin(t * angle) * end) / math.sin(angle)


def _grid_minimum(points: np.ndarray, geometry: str) -> float:
    """Min over (t, u) in [0, 1]^2 of |p1(t) - p2(u)|: a 161 x 161 grid, then L-BFGS-B (bounded) from
    the six best grid points, so the result is accurate far below the 1e-4 the tests ask for."""
    optimize = pytest.importorskip("scipy.optimize")
    x1, x2, y1, y2 = points

    def squared(tu: np.ndarray) -> np.ndarray:
        diff = _curve(x1, x2, tu[..., 0], geometry) - _curve(y1, y2, tu[..., 1], geometry)
        return (diff**2).sum(-1)

    grid = np.stack(np.meshgrid(np.linspace(0, 1, 161), np.linspace(0, 1, 161), indexing="ij"), -1)
    values = squared(grid)
    best = values.min()
    for flat in np.argsort(values, axis=None)[:6]:
        start = grid.reshape(-1, 2)[flat]
        result = optimize.minimize(
            lambda tu: float(squared(tu)), start, method="L-BFGS-B", bounds=[(0, 1)] * 2
        )
        best = min(best, float(result.fun))
    return math.sqrt(max(best, 0.0))


# ---------------------------------------------------------------------------------------------------
# (a), (h): the closed form is the minimum over the two curves
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dim", [3, 5])
def test_closed_form_equals_grid_search(geometry: str, dim: int) -> None:
    points = _tuples(seed=dim, count=25, dim=dim, geometry=geometry)
    ours = curve_distances(*points, geometry=geometry)
    for n in range(points.shape[1]):
        grid = _grid_minimum(points[:, n].numpy(), geometry)
        assert abs(ours.distance[n].item() - grid) < 1e-4, (n, ours.case[n].item())
        # an exact minimum is never beaten by a search (1e-6: the clamp of a zero distance)
        assert ours.distance[n].item() <= grid + 1e-9 or ours.distance[n].item() <= 1e-6
    assert len(ours.case.unique()) >= 5  # the random tuples exercise many cases, not just the corners


# ---------------------------------------------------------------------------------------------------
# (b): never above the endpoint distances
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_never_exceeds_the_endpoint_distances(geometry: str) -> None:
    x1, x2, y1, y2 = _tuples(seed=1, count=500, dim=4, geometry=geometry)
    ends = torch.stack([(a - b).norm(dim=-1) for a in (x1, x2) for b in (y1, y2)])
    ours = curve_distances(x1, x2, y1, y2, geometry=geometry).distance
    assert (ours <= ends.amin(0) + 1e-12).all()

    batch = _tuples(seed=2, count=24, dim=6, geometry=geometry).reshape(-1, 6)  # 96 rows = 48 pairs
    squared = pairwise_distances(batch).square()
    optimum = pair_of_pair_distances(squared, geometry).distance
    blocks = squared.sqrt().view(48, 2, 48, 2).amin((1, 3))
    assert (optimum <= blocks + 1e-12).all()


# ---------------------------------------------------------------------------------------------------
# (c): every KKT case of Table 1 is reached by a constructed input
# ---------------------------------------------------------------------------------------------------


def _sphere(lat: float, lon: float) -> list[float]:
    lat, lon = math.radians(lat), math.radians(lon)
    return [math.cos(lat) * math.cos(lon), math.cos(lat) * math.sin(lon), math.sin(lat)]


def _inner_arcs() -> list[list[float]]:
    """Two arcs in R^4 whose closest points are both inside (case 0): p1.p2 = 0.8 cos a cos b
    + 0.5 sin a sin b for angles a, b in [-30, 30] degrees, largest at a = b = 0."""
    c1, s1, c2, s2 = 0.8, 0.6, 0.5, math.sqrt(0.75)

    def x(a: float) -> list[float]:
        return [math.cos(math.radians(a)), math.sin(math.radians(a)), 0.0, 0.0]

    def y(b: float) -> list[float]:
        cb, sb = math.cos(math.radians(b)), math.sin(math.radians(b))
        return [cb * c1, sb * c2, cb * s1, sb * s2]

    return [x(-30), x(30), y(-30), y(30)]


_EQUATOR = [_sphere(0, -40), _sphere(0, 40)]
_UP = [_sphere(20, 0), _sphere(60, 10)]  # starts above the middle of the equator arc, moves away
_NORTH, _SOUTH = [_sphere(10, 0), _sphere(60, 30)], [_sphere(-10, 5), _sphere(-60, -30)]  # nearest: ends 1
ARC_CASES = {
    0: _inner_arcs(),
    1: [*_UP, *_EQUATOR],
    2: [*_UP[::-1], *_EQUATOR],
    3: [*_EQUATOR, *_UP],
    4: [*_EQUATOR, *_UP[::-1]],
    5: [*_NORTH, *_SOUTH],
    6: [*_NORTH, *_SOUTH[::-1]],
    7: [*_NORTH[::-1], *_SOUTH],
    8: [*_NORTH[::-1], *_SOUTH[::-1]],
}
_LINE = [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
_AWAY = [[0.0, 0.5, 0.2], [0.3, 2.0, 0.5]]
_LEFT, _RIGHT = [[0.0, 0.5, 0.0], [0.5, 2.0, 0.3]], [[0.1, -0.5, 0.0], [-0.5, -2.0, -0.3]]
SEGMENT_CASES = {
    0: [[0.0, -1.0, 1.0], [0.0, 1.0, 1.0], *_LINE],
    1: [*_AWAY, *_LINE],
    2: [*_AWAY[::-1], *_LINE],
    3: [*_LINE, *_AWAY],
    4: [*_LINE, *_AWAY[::-1]],
    5: [*_LEFT, *_RIGHT],
    6: [*_LEFT, *_RIGHT[::-1]],
    7: [*_LEFT[::-1], *_RIGHT],
    8: [*_LEFT[::-1], *_RIGHT[::-1]],
}


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("case", range(9))
def test_each_kkt_case_is_reached(geometry: str, case: int) -> None:
    points = torch.tensor((ARC_CASES if geometry == "arc" else SEGMENT_CASES)[case], dtype=torch.float64)
    ours = curve_distances(*points, geometry=geometry)
    assert ours.case.item() == case
    assert abs(ours.distance.item() - _grid_minimum(points.numpy(), geometry)) < 1e-4
    reference = (arc_reference if geometry == "arc" else segment_reference)(*points.tolist())
    assert reference[1] == case
    torch.testing.assert_close(ours.distance.item(), reference[0], rtol=0, atol=1e-9)
    # where the points are: free parameters strictly inside, fixed ones at 0 or at the far end
    far_x = math.acos(points[0] @ points[1]) if geometry == "arc" else 1.0
    far_y = math.acos(points[2] @ points[3]) if geometry == "arc" else 1.0
    alpha, beta = ours.alpha.item(), ours.beta.item()
    expected_alpha = {1: 0.0, 5: 0.0, 6: 0.0, 2: far_x, 7: far_x, 8: far_x}.get(case)
    expected_beta = {3: 0.0, 5: 0.0, 7: 0.0, 4: far_y, 6: far_y, 8: far_y}.get(case)

    # (e) the gradient at a strict optimum of each case (unnormalised inputs are projected for arcs)
    def distance(raw: torch.Tensor) -> torch.Tensor:
        return curve_distances(
            *(raw / raw.norm(dim=-1, keepdim=True) if geometry == "arc" else raw), geometry=geometry
        ).distance

    assert torch.autograd.gradcheck(distance, (points.clone().requires_grad_(True),))
    if expected_alpha is None:
        assert 0 < alpha < far_x
    else:
        assert alpha == pytest.approx(expected_alpha, abs=1e-12)
    if expected_beta is None:
        assert 0 < beta < far_y
    else:
        assert beta == pytest.approx(expected_beta, abs=1e-12)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_batch_reaches_all_cases_and_matches_the_tuple_form(geometry: str) -> None:
    """Algorithm 1: all pairs of consecutive pairs at once, equal to the one-pair-of-pairs form."""
    cases = ARC_CASES if geometry == "arc" else SEGMENT_CASES
    # pair 2c is the first curve of case c, pair 2c + 1 the second; the case-0 arcs live in R^4
    rows = torch.tensor(
        [point + [0.0] * (4 - len(point)) for c in range(9) for point in cases[c]], dtype=torch.float64
    )
    batch = pair_of_pair_distances(pairwise_distances(rows).square(), geometry)
    pairs = len(rows) // 2
    p, q = torch.meshgrid(torch.arange(pairs), torch.arange(pairs), indexing="ij")
    single = curve_distances(rows[2 * p], rows[2 * p + 1], rows[2 * q], rows[2 * q + 1], geometry)
    torch.testing.assert_close(batch.distance, single.distance, rtol=0, atol=1e-9)
    for case in range(9):  # each constructed pair of pairs, (2c, 2c + 1); other entries may tie
        assert batch.case[2 * case, 2 * case + 1].item() == case == single.case[2 * case, 2 * case + 1].item()
    torch.testing.assert_close(batch.distance, batch.distance.T, rtol=0, atol=1e-9)
    assert (batch.distance.diagonal() <= 1e-6).all()


# ---------------------------------------------------------------------------------------------------
# (f): the vectorised closed form equals the paper-literal reference
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dim", [4, 6])
def test_matches_the_paper_reference(geometry: str, dim: int) -> None:
    points = _tuples(seed=10 + dim, count=300, dim=dim, geometry=geometry)
    ours = curve_distances(*points, geometry=geometry)
    reference = [
        (arc_reference if geometry == "arc" else segment_reference)(*points[:, n].tolist())
        for n in range(300)
    ]
    distance, case, alpha, beta = (
        torch.tensor(column, dtype=torch.float64) for column in zip(*reference, strict=True)
    )
    torch.testing.assert_close(ours.distance, distance, rtol=0, atol=1e-9)
    assert torch.equal(ours.case, case.long())
    torch.testing.assert_close(ours.alpha, alpha, rtol=0, atol=1e-7)
    torch.testing.assert_close(ours.beta, beta, rtol=0, atol=1e-7)
    assert len(set(ours.case.tolist())) >= 8


# ---------------------------------------------------------------------------------------------------
# (e): gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_gradcheck_tuple_form(geometry: str) -> None:
    """Away from case boundaries (random tuples covering all cases), float64."""
    raw = _tuples(
        seed=0 if geometry == "arc" else 1, count=60 if geometry == "arc" else 100, dim=5, geometry="segment"
    )
    points = raw / raw.norm(dim=-1, keepdim=True) if geometry == "arc" else raw
    assert set(curve_distances(*points, geometry=geometry).case.tolist()) == set(range(9))

    def distance(points: torch.Tensor) -> torch.Tensor:
        if geometry == "arc":
            points = points / points.norm(dim=-1, keepdim=True)
        return curve_distances(*points, geometry=geometry).distance

    # the Jacobian is block-diagonal over tuples: fast mode (random projections) checks it in one pass
    assert torch.autograd.gradcheck(distance, (raw.clone().requires_grad_(True),), fast_mode=True)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_gradcheck_batch_form(geometry: str) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(1, 5, generator=gen, dtype=torch.float64) + torch.randn(
        12, 5, generator=gen, dtype=torch.float64
    )

    def optimum(x: torch.Tensor) -> OptimalNegatives:
        if geometry == "arc":
            x = x / x.norm(dim=1, keepdim=True)
        return pair_of_pair_distances(pairwise_distances(x).square(), geometry)

    off_diagonal = ~torch.eye(6, dtype=torch.bool)
    assert len(optimum(rows).case[off_diagonal].unique()) >= 8
    assert torch.autograd.gradcheck(lambda x: optimum(x).distance, (rows.requires_grad_(True),))


# ---------------------------------------------------------------------------------------------------
# (g): identical, antipodal, collinear and zero-length inputs stay finite
# ---------------------------------------------------------------------------------------------------

_E = [[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.0, 0.6, 0.8], [0.0, 0.0, 1.0]]
DEGENERATE = {
    "same pair member": [_E[0], _E[0], _E[2], _E[3]],
    "same other member": [_E[0], _E[1], _E[2], _E[2]],
    "shared endpoint": [_E[0], _E[1], _E[0], _E[3]],
    "all identical": [_E[1]] * 4,
    "identical pairs": [_E[0], _E[1], _E[0], _E[1]],
    "antipodal pair": [_E[0], [-1.0, 0.0, 0.0], _E[2], _E[3]],
    "antipodal across": [_E[0], _E[1], [-1.0, 0.0, 0.0], [-0.6, -0.8, 0.0]],
    "collinear overlapping": [_E[0], [0.0, 1.0, 0.0], _E[1], [-0.6, 0.8, 0.0]],
    "collinear apart": [_E[0], _E[1], [-0.6, 0.8, 0.0], [-0.8, -0.6, 0.0]],
    "nearly identical pair": [_E[0], [1.0, 1e-9, 0.0], _E[2], _E[3]],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("name", sorted(DEGENERATE))
def test_degenerate_inputs_are_finite(name: str, geometry: str, dtype: torch.dtype) -> None:
    raw = torch.tensor(DEGENERATE[name], dtype=dtype, requires_grad=True)
    points = raw / raw.norm(dim=-1, keepdim=True) if geometry == "arc" else raw
    ours = curve_distances(*points, geometry=geometry)
    assert (
        torch.isfinite(ours.distance).all()
        and torch.isfinite(ours.alpha).all()
        and torch.isfinite(ours.beta).all()
    )
    ends = min((points[a] - points[b]).detach().norm().item() for a in (0, 1) for b in (2, 3))
    assert ours.distance.detach().item() <= ends + 1e-6
    ours.distance.sum().backward()
    assert torch.isfinite(raw.grad).all()

    # the same four rows as a batch of two pairs
    rows = raw.detach().clone().requires_grad_(True)
    x = rows / rows.norm(dim=1, keepdim=True) if geometry == "arc" else rows
    batch = pair_of_pair_distances(pairwise_distances(x).square(), geometry).distance
    assert torch.isfinite(batch).all()
    batch[0, 1].backward()
    assert torch.isfinite(rows.grad).all()


def test_zero_and_parallel_segments_are_finite() -> None:
    cases = [
        [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]],  # two points
        [[0.0, 0.0], [2.0, 0.0], [1.0, 1.0], [3.0, 1.0]],  # parallel, overlapping in projection
        [[0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [3.0, 0.0]],  # collinear, overlapping
        [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],  # all at one point
    ]
    for points in cases:
        raw = torch.tensor(points, dtype=torch.float64, requires_grad=True)
        ours = curve_distances(*raw, geometry="segment")
        ours.distance.backward()
        assert torch.isfinite(ours.distance) and torch.isfinite(raw.grad).all()
    overlapping = curve_distances(*torch.tensor(cases[2], dtype=torch.float64), geometry="segment")
    assert overlapping.distance.item() <= 1e-6


def test_float32_tracks_float64_at_training_size() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.nn.functional.normalize(torch.randn(128, 512, generator=gen, dtype=torch.float64), dim=1)
    exact = pair_of_pair_distances(pairwise_distances(x).square()).distance
    single = pair_of_pair_distances(pairwise_distances(x.float()).square()).distance
    off_diagonal = ~torch.eye(64, dtype=torch.bool)  # a pair against itself is 0 up to float32 noise
    torch.testing.assert_close(single.double()[off_diagonal], exact[off_diagonal], rtol=0, atol=1e-5)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="B even"):
        pair_of_pair_distances(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="geometry"):
        pair_of_pair_distances(torch.zeros(4, 4), "line")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="geometry"):
        curve_distances(*torch.eye(4), geometry="line")  # type: ignore[arg-type]
