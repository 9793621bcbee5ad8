"""Refining a search by examples: Qdrant's two strategies against numpy, alone and through the service."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.serve.item_reader import ItemNotFoundError
from engine.serve.query import ItemQuery, RerankUnavailableError, SearchOptions
from engine.serve.refine import ExamplesError, Refinement, Strategy, average_vector, best_score
from engine.serve.search import SearchService
from foundation import defaults
from index.filters import ItemFilter

RNG = np.random.default_rng(40)


def _unit(rows: int, dim: int = 8) -> np.ndarray:
    vectors = RNG.normal(size=(rows, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _reference_best_score(candidate: np.ndarray, positive: np.ndarray, negative: np.ndarray) -> float:
    """Qdrant's definition, one candidate at a time: the max over the positives' scores and the negatives'
    scores; the negative's squared and negated where it is the max (a tie goes to the negative, as
    Qdrant's ``max_positive > max_negative`` does)."""
    max_positive = max(float(np.dot(candidate, p)) for p in positive)
    if len(negative) == 0:
        return max_positive
    max_negative = max(float(np.dot(candidate, n)) for n in negative)
    return max_positive if max_positive > max_negative else -(max_negative**2)


def test_average_vector_is_twice_the_positive_mean_less_the_negative_mean() -> None:
    positive, negative = _unit(3), _unit(2)
    expected = [2 * sum(p[i] for p in positive) / 3 - sum(n[i] for n in negative) / 2 for i in range(8)]
    np.testing.assert_allclose(average_vector(positive, negative), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(average_vector(positive, negative[:0]), positive.mean(axis=0), atol=1e-7)
    np.testing.assert_allclose(average_vector(positive[:1], negative[:0]), positive[0], atol=1e-7)


def test_best_score_matches_the_definition_candidate_by_candidate() -> None:
    candidates, positive, negative = _unit(50), _unit(3), _unit(2)
    # Candidates equal to an example: a sure positive win (1 > anything else) and a sure negative one.
    candidates[0], candidates[1] = positive[1], negative[0]
    scores = best_score(candidates, positive, negative)
    expected = [_reference_best_score(c, positive, negative) for c in candidates]
    np.testing.assert_allclose(scores, expected, atol=1e-6)
    assert scores[0] == pytest.approx(1.0, abs=1e-6) and scores[1] == pytest.approx(-1.0, abs=1e-6)
    chosen_negative = [i for i, score in enumerate(expected) if score <= 0 and i != 1]
    assert chosen_negative  # the data exercise both branches
    no_negative = best_score(candidates, positive, negative[:0])
    np.testing.assert_allclose(no_negative, (candidates @ positive.T).max(axis=1), atol=1e-6)


def test_a_refinement_refuses_too_many_examples_and_one_judged_both_ways() -> None:
    Refinement(positive=tuple(range(defaults.MAX_EXAMPLES)))  # the limit itself is taken
    with pytest.raises(ExamplesError, match=f"at most {defaults.MAX_EXAMPLES}") as too_many:
        Refinement(positive=tuple(range(defaults.MAX_EXAMPLES)), negative=(-1,))
    assert too_many.value.code == "too_many_examples"
    with pytest.raises(ExamplesError, match="item 3 is both") as both:
        Refinement(positive=(1, 3), negative=(3,))
    assert both.value.code == "conflicting_examples"
    with pytest.raises(ExamplesError, match="1 uploaded image"):
        Refinement(positive=(b"same",), negative=(b"same", 4))


@pytest.fixture(scope="module")
def service(demo_index: Path) -> SearchService:
    return SearchService.open(None, demo_index, threads=1)


def _whole_ranking(service: SearchService, query: bytes | ItemQuery, **options: object) -> list:
    """Every result the refined search gives, the whole gallery asked for."""
    found = service.queries.search([query], SearchOptions(k=len(service.index), **options))  # type: ignore[arg-type]
    return found.queries[0].results


@pytest.mark.parametrize("strategy", list(Strategy))
def test_the_service_ranks_the_whole_gallery_as_the_reference_does(
    service: SearchService, demo_gallery: Path, strategy: Strategy
) -> None:
    """The refined ranking of every item is the plain-numpy one over the stored vectors: a refined search
    is an item search (the query item left out) with the examples left out too."""
    items, total = service.reader.page(0, 1000)
    ids = [item.id for item in items]
    vectors = service.index.vectors(ids)
    by_id = dict(zip(ids, vectors, strict=True))
    query, liked, disliked = ids[0], ids[5], [ids[-1], ids[-4]]
    refine = Refinement(positive=(liked,), negative=tuple(disliked), strategy=strategy)
    results = _whole_ranking(service, ItemQuery(query), refine=refine)

    positive = np.stack([by_id[query], by_id[liked]])
    negative = np.stack([by_id[i] for i in disliked])
    if strategy is Strategy.AVERAGE_VECTOR:
        refined = average_vector(positive, negative)
        reference = vectors @ (refined / np.linalg.norm(refined))
    else:
        reference = np.array([_reference_best_score(v, positive, negative) for v in vectors])
    expected = dict(zip(ids, reference.tolist(), strict=True))
    assert {r.id for r in results} == set(ids) - {query, liked, *disliked}
    assert len(results) == total - 4
    for result in results:  # the query item is embedded again from its file: the stored vector within 1e-3
        assert result.score == pytest.approx(expected[result.id], abs=1e-3)
    scores = [r.score for r in results]
    assert scores == sorted(scores, reverse=True)
    assert [r.rank for r in results] == list(range(1, len(results) + 1))


@pytest.mark.parametrize("strategy", list(Strategy))
def test_filters_min_score_and_paging_apply_to_a_refined_search(
    service: SearchService, demo_gallery: Path, strategy: Strategy
) -> None:
    items, _ = service.reader.page(0, 1000)
    query = items[0]
    liked = next(item for item in items[1:] if item.label == query.label)
    disliked = next(item for item in items if item.label != query.label)
    upload = (demo_gallery / query.path).read_bytes()
    refine = Refinement(positive=(liked.id,), negative=(disliked.id,), strategy=strategy)
    whole = _whole_ranking(service, upload, refine=refine)
    assert liked.id not in {r.id for r in whole} and disliked.id not in {r.id for r in whole}
    page = service.queries.search([upload], SearchOptions(k=3, offset=2, refine=refine)).queries[0].results
    assert [(r.id, r.rank) for r in page] == [(r.id, r.rank) for r in whole[2:5]]
    cut = (whole[3].score + whole[4].score) / 2
    assert [r.id for r in _whole_ranking(service, upload, refine=refine, min_score=cut)] == [
        r.id for r in whole[:4]
    ]
    where = ItemFilter(labels=(disliked.label,))
    filtered = _whole_ranking(service, upload, refine=refine, where=where)
    assert filtered and {r.label for r in filtered} == {disliked.label}
    assert [r.id for r in filtered] == [r.id for r in whole if r.label == disliked.label]


def test_an_uploaded_example_counts_as_its_item_does(service: SearchService, demo_gallery: Path) -> None:
    items, _ = service.reader.page(0, 1000)
    query, liked, disliked = items[2], items[7], items[11]
    as_ids = Refinement(positive=(liked.id,), negative=(disliked.id,))
    as_uploads = Refinement(
        positive=((demo_gallery / liked.path).read_bytes(),),
        negative=((demo_gallery / disliked.path).read_bytes(),),
    )
    by_ids = _whole_ranking(service, ItemQuery(query.id), refine=as_ids)
    by_uploads = _whole_ranking(service, ItemQuery(query.id), refine=as_uploads)
    # Uploads are not items: they are not left out, and score about 1 against themselves.
    uploaded_scores = {r.id: r.score for r in by_uploads}
    for result in by_ids:
        assert uploaded_scores[result.id] == pytest.approx(result.score, abs=1e-3)


def test_refinement_refusals(service: SearchService) -> None:
    items, _ = service.reader.page(0, 3)
    with pytest.raises(ItemNotFoundError, match="no item with id 999999"):
        _whole_ranking(service, ItemQuery(items[0].id), refine=Refinement(positive=(items[1].id, 999999)))
    with pytest.raises(ExamplesError, match="is the query") as query_negative:
        _whole_ranking(service, ItemQuery(items[0].id), refine=Refinement(negative=(items[0].id,)))
    assert query_negative.value.code == "conflicting_examples"
    with pytest.raises(RerankUnavailableError, match="does not combine"):
        liked = Refinement(positive=(items[1].id,))
        _whole_ranking(service, ItemQuery(items[0].id), refine=liked, rerank="pddm")
