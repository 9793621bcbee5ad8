"""engine.serve.ranking: from one query's hits (a real FAISS index's) to the page a client sees."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.serve.ranking import RERANK_POOL_FACTOR, rank_page, rerank_depth
from engine.serve.voting import knn_vote
from index.gallery import GalleryIndex, Hit
from index.protocol import Entry
from index.selection import IndexOptions
from tests.support.vectors import clustered_vectors, entries

DIM = 16
COUNT = 40
SIGMA2 = 0.1
UNLABELLED = 3  # items added without a label: they rank, but do not vote


@pytest.fixture
def hits(tmp_path: Path) -> Iterator[list[Hit]]:
    """The 20 nearest items of one query, as an exact FAISS index ranks them (best first)."""
    index = GalleryIndex.create(
        tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None, options=IndexOptions("flat")
    )
    vectors = clustered_vectors(COUNT, DIM, clusters=4, spread=0.6)
    labelled = entries(COUNT - UNLABELLED)
    unlabelled = [Entry(f"loose/{i}.png", None, f"loose-{i}") for i in range(UNLABELLED)]
    index.add(vectors, labelled + unlabelled)
    index.save()
    (found,) = index.search(vectors[-1:], 20)  # an unlabelled item's vector: it is its own best hit
    yield found
    index.close()


def test_without_pddm_the_index_order_is_kept_and_ranks_are_global(hits: list[Hit]) -> None:
    page = rank_page(hits, None, k=5, offset=5, predict=False, vote_sigma2=SIGMA2)
    assert [r.id for r in page.results] == [hit.item.id for hit in hits[5:10]]
    assert [r.rank for r in page.results] == [6, 7, 8, 9, 10]
    assert [(r.path, r.label, r.score) for r in page.results] == [
        (hit.item.path, hit.item.label, hit.score) for hit in hits[5:10]
    ]
    assert all(r.pddm_score is None for r in page.results)
    assert page.prediction is None
    whole = rank_page(hits, None, k=len(hits), offset=0, predict=False, vote_sigma2=SIGMA2)
    assert [r.score for r in whole.results] == sorted((hit.score for hit in hits), reverse=True)


def test_pddm_scores_reorder_stably_and_keep_the_cosine_scores(hits: list[Hit]) -> None:
    # Reverse the cosine order, except that the first four tie: a tie keeps the cosine order.
    pddm = np.array([1.0] * 4 + [0.5 - 0.01 * i for i in range(len(hits) - 4)], dtype=np.float32)
    pddm[-1] = 2.0  # the cosine's last hit is the PDDM unit's best
    page = rank_page(hits, pddm, k=6, offset=0, predict=False, vote_sigma2=SIGMA2)
    expected = [len(hits) - 1, 0, 1, 2, 3, 4]
    assert [r.id for r in page.results] == [hits[i].item.id for i in expected]
    assert [r.rank for r in page.results] == [1, 2, 3, 4, 5, 6]
    assert [r.score for r in page.results] == [hits[i].score for i in expected]
    assert [r.pddm_score for r in page.results] == pytest.approx([float(pddm[i]) for i in expected])
    second = rank_page(hits, pddm, k=6, offset=6, predict=False, vote_sigma2=SIGMA2)
    assert [r.id for r in second.results] == [hits[i].item.id for i in range(5, 11)]
    assert [r.rank for r in second.results] == list(range(7, 13))


def test_the_vote_covers_every_hit_above_the_page_end_in_ranked_order(hits: list[Hit]) -> None:
    k, offset = 4, 6
    pddm = np.linspace(0.0, 1.0, len(hits), dtype=np.float32)  # the reverse of the cosine order
    page = rank_page(hits, pddm, k=k, offset=offset, predict=True, vote_sigma2=SIGMA2)
    voters = hits[::-1][: offset + k]  # not only the page, and the re-ranked top, not the cosine's
    expected = knn_vote([h.item.label for h in voters], [h.score for h in voters], sigma2=SIGMA2)
    assert expected is not None and page.prediction == expected
    cosine_voters = hits[: offset + k]
    assert page.prediction != knn_vote(
        [h.item.label for h in cosine_voters], [h.score for h in cosine_voters], sigma2=SIGMA2
    )


def test_unlabelled_voters_give_no_prediction(hits: list[Hit]) -> None:
    unlabelled = [hit for hit in hits if hit.item.label is None]
    assert len(unlabelled) == UNLABELLED
    page = rank_page(unlabelled, None, k=10, offset=0, predict=True, vote_sigma2=SIGMA2)
    assert len(page.results) == UNLABELLED and page.prediction is None


def test_no_hits_and_a_page_past_the_end_are_empty(hits: list[Hit]) -> None:
    empty = rank_page([], None, k=5, offset=0, predict=True, vote_sigma2=SIGMA2)
    assert empty.results == [] and empty.prediction is None
    past = rank_page(hits, None, k=5, offset=len(hits), predict=False, vote_sigma2=SIGMA2)
    assert past.results == []


def test_rerank_depth_is_the_pool_or_a_multiple_of_k() -> None:
    assert rerank_depth(5, 100) == 100
    assert rerank_depth(50, 100) == RERANK_POOL_FACTOR * 50
