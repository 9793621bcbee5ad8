"""Explaining a result: both heatmaps split the cosine the search served, for an upload or an item."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.build.indexing import build_index
from engine.model.embedder import Embedder
from engine.serve.explain import ExplainUnavailableError, matched_windows
from engine.serve.item_reader import ItemNotFoundError
from engine.serve.query import ItemQuery, SearchOptions
from engine.serve.search import SearchService


@pytest.fixture(scope="module")
def service(demo_index: Path) -> SearchService:
    return SearchService.open(None, demo_index, threads=1)


def _served_score(service: SearchService, query: bytes | ItemQuery, item_id: int) -> float:
    results = service.queries.search([query], SearchOptions(k=len(service.index))).queries[0].results
    return next(result.score for result in results if result.id == item_id)


@pytest.mark.parametrize("by", ["upload", "item"])
def test_both_heatmaps_sum_to_the_served_cosine(service: SearchService, demo_gallery: Path, by: str) -> None:
    first, second = service.reader.page(0, 2)[0]
    query = (demo_gallery / first.path).read_bytes() if by == "upload" else ItemQuery(first.id)
    explanation = service.explanations.explain(query, second.id)
    assert explanation.cosine == pytest.approx(_served_score(service, query, second.id), abs=1e-3)
    for heatmap in (explanation.query, explanation.item):
        assert heatmap.grid.shape == (7, 7) and heatmap.view.shape == (224, 224, 3)
        assert heatmap.total == pytest.approx(explanation.cosine, abs=2e-5)
        assert np.ptp(heatmap.grid) > 0  # positions differ
    assert explanation.model_fingerprint == service.model_fingerprint


def test_an_unknown_item_is_named(service: SearchService) -> None:
    with pytest.raises(ItemNotFoundError, match="no item with id 999999"):
        service.explanations.explain(ItemQuery(999999), service.reader.page(0, 1)[0][0].id)


def test_a_model_without_explainer_says_to_re_export(
    small_model: Path, demo_gallery: Path, tmp_path: Path
) -> None:
    build_index(demo_gallery, Embedder(small_model), tmp_path / "index", progress=False)
    old = SearchService.open(None, tmp_path / "index", threads=1)
    item = old.reader.page(0, 1)[0][0]
    with pytest.raises(ExplainUnavailableError, match="has no explainer: re-export it"):
        old.explanations.explain(ItemQuery(item.id), item.id)
    old.close()


def test_the_peaks_are_the_two_windows_that_show_the_same_thing_most_specifically() -> None:
    rng = np.random.default_rng(0)
    query = rng.normal(0, 0.01, (7, 7, 16)).astype(np.float32)
    item = rng.normal(0, 0.01, (7, 7, 16)).astype(np.float32)
    shared = np.zeros(16, np.float32)
    shared[3] = 0.1
    query[3:6, 1:4] += shared  # the same region in both images, at different places
    item[0:3, 4:7] += shared
    query[0, 0, 5] = item[6, 6, 5] = 0.5  # a stronger pair of single positions, alone: not a window
    item[..., 7] += 0.02  # a background all over the item ...
    query[0:3, 4:7, 7] += 0.6  # ... and a salient query region a little alike all of it
    query[0:3, 0:3, 9:11] += [1.2, 1.6]  # loud regions, one in each image, only partly alike (cosine 0.36)
    item[4:7, 0:3, 9:12:2] += [1.2, 1.6]
    pairs = np.einsum("ijd,kld->ijkl", query, item)  # every pair of positions, by brute force
    windows = np.lib.stride_tricks.sliding_window_view(pairs, (3, 3, 3, 3)).sum(axis=(4, 5, 6, 7))
    assert np.unravel_index(np.argmax(windows), windows.shape) == (0, 0, 4, 0)  # the largest share: loud
    centred = windows - windows.mean(axis=(2, 3), keepdims=True) - windows.mean(axis=(0, 1), keepdims=True)
    assert np.unravel_index(np.argmax(centred), centred.shape) == (0, 0, 4, 0)  # also beyond the averages
    peak_q, peak_i = matched_windows(query, item)
    assert (peak_q.top, peak_q.left, peak_q.size) == (3, 1, 3)  # the shared region, in both images
    assert (peak_i.top, peak_i.left, peak_i.size) == (0, 4, 3)
    assert peak_q.share == peak_i.share == pytest.approx(float(windows[3, 1, 0, 4]), rel=1e-5)
    assert peak_q.box((7, 7), (224, 224)) == (32, 96, 128, 192)
    small = matched_windows(query[:2, :2], item[:2, :2])[0]  # a grid smaller than the window
    assert (small.size, small.top, small.left) == (2, 0, 0)
    silent = matched_windows(np.zeros_like(query), item)  # positions that add nothing: no division by 0
    assert np.isfinite(silent[0].share)


def _pasted(background: np.ndarray, thing: np.ndarray, x: int, y: int) -> bytes:
    pixels = background.copy()
    pixels[y : y + thing.shape[0], x : x + thing.shape[1]] = thing
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_peak_points_at_an_object_pasted_into_two_backgrounds(
    exported_model: Path, tmp_path: Path
) -> None:
    """Real model, real onnxruntime: an 80-px object (a red and black checkerboard around a yellow disc)
    pasted into two smooth, different backgrounds at different places; the peak window of each image holds
    the object's centre."""
    yy, xx = np.mgrid[0:224, 0:224].astype(np.float32)
    backgrounds = [
        np.stack([80 + 0.3 * xx, 120 + 0.2 * yy, 160 - 0.2 * xx], -1).astype(np.uint8),
        np.stack([200 - 0.4 * yy, 90 + 0.1 * xx, 60 + 0.3 * yy], -1).astype(np.uint8),
    ]
    ty, tx = np.mgrid[0:80, 0:80]
    thing = np.where(((ty // 10 + tx // 10) % 2)[..., None] == 1, [200, 20, 20], [10, 10, 10])
    thing[(ty - 40) ** 2 + (tx - 40) ** 2 < 15**2] = [250, 220, 0]
    thing = thing.astype(np.uint8)
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    (gallery / "pasted.png").write_bytes(_pasted(backgrounds[1], thing, 130, 120))
    build_index(gallery, Embedder(exported_model), tmp_path / "index", progress=False)
    service = SearchService.open(None, tmp_path / "index", threads=1)
    item = service.reader.page(0, 1)[0][0]
    explanation = service.explanations.explain(_pasted(backgrounds[0], thing, 20, 40), item.id)
    service.close()
    for heatmap, (x, y) in ((explanation.query, (20, 40)), (explanation.item, (130, 120))):
        x0, y0, x1, y1 = heatmap.peak_box
        assert x0 <= x + 40 < x1 and y0 <= y + 40 < y1, (heatmap.peak_box, (x, y))
    assert 0 < explanation.query.peak.share == explanation.item.peak.share < explanation.cosine
