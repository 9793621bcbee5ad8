"""Explaining a result: both heatmaps split the cosine the search served, for an upload or an item."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.embedder import Embedder
from engine.explain import ExplainUnavailableError
from engine.indexing import build_index
from engine.item_reader import ItemNotFoundError
from engine.query import ItemQuery, SearchOptions
from engine.search import SearchService


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
