"""One behaviour suite for every backend: FAISS flat, HNSW, IVF, IVF-SQ8, IVF-PQ, Milvus Lite and the real
Milvus server (2.3, the oldest the backend supports)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from index.connection import MilvusConnection
from index.gallery import GalleryIndex, IndexMismatchError
from index.protocol import Entry, Move
from index.selection import IndexOptions
from tests.support.milvus_server import MILVUS_BACKENDS, MILVUS_PARAMS, milvus_target
from tests.support.vectors import clustered_vectors, entries

DIM = 32
COUNT = 600
BACKENDS = ["faiss-flat", "faiss-hnsw", "faiss-ivf", "faiss-ivfsq", "faiss-ivfpq", *MILVUS_PARAMS]
# Fraction of exact top-10 neighbours each backend must find on these small sets (PQ codes are lossy).
MIN_RECALL = {
    "faiss-flat": 1.0,
    "faiss-hnsw": 0.9,
    "faiss-ivf": 0.9,
    "faiss-ivfsq": 0.9,
    "faiss-ivfpq": 0.5,
    "milvus-lite": 0.9,
    "milvus-server": 0.9,
}

MakeIndex = Callable[[], GalleryIndex]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_index(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> MakeIndex:
    milvus = milvus_target(backend, request, tmp_path) if backend in MILVUS_BACKENDS else None

    def make() -> GalleryIndex:
        if milvus is not None:
            return GalleryIndex.create(
                tmp_path / "index", dim=DIM, model_fingerprint="model-a", gallery_root=None, **milvus
            )
        options = IndexOptions(backend.removeprefix("faiss-"), target_recall=0.95)
        return GalleryIndex.create(
            tmp_path / "index", dim=DIM, model_fingerprint="model-a", gallery_root=None, options=options
        )

    return make


@pytest.fixture
def filled(make_index: MakeIndex) -> tuple[GalleryIndex, list[int], np.ndarray]:
    vectors = clustered_vectors(COUNT, DIM)
    index = make_index()
    ids = index.add(vectors, entries(COUNT))
    index.save()
    yield index, ids, vectors
    index.close()


def _exact_top(vectors: np.ndarray, ids: list[int], queries: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :k]
    return np.asarray(ids)[order]


def test_ids_are_distinct_and_metadata_is_kept(filled: tuple[GalleryIndex, list[int], np.ndarray]) -> None:
    index, ids, _ = filled
    assert len(set(ids)) == COUNT == len(index)
    item = index.items.get(ids[5])
    assert Entry(item.path, item.label, item.content_hash) == entries(COUNT)[5]
    assert index.items.get_by_path("img/00007.png").id == ids[7]
    assert index.items.get_by_path("img/missing.png") is None
    assert index.items.get_by_content(entries(COUNT)[9].content_hash).id == ids[9]
    assert index.items.get_by_content("no-such-hash") is None
    assert [i.id for i in index.items.page(0, 3)] == sorted(ids)[:3]
    assert {i.id for i in index.items.scan()} == set(ids)


def test_search_returns_cosine_scores_best_first_and_finds_neighbours(
    filled: tuple[GalleryIndex, list[int], np.ndarray], backend: str
) -> None:
    index, ids, vectors = filled
    queries = clustered_vectors(40, DIM, seed=99)  # unseen vectors from the same clusters
    hits = index.search(queries, 10)
    truth = _exact_top(vectors, ids, queries, 10)
    recall = np.mean(
        [len({h.item.id for h in row} & set(t)) / 10 for row, t in zip(hits, truth, strict=True)]
    )
    assert recall >= MIN_RECALL[backend]
    for row, query in zip(hits, queries, strict=True):
        scores = [hit.score for hit in row]
        assert scores == sorted(scores, reverse=True)
        assert [hit.rank for hit in row] == list(range(1, len(row) + 1))
        assert all(-1.0 - 1e-5 <= s <= 1.0 + 1e-5 for s in scores)
        # The score is the cosine of the query with the item found, up to the codes it is searched through:
        # PQ, 8-bit SQ, a graph's 16-bit floats.
        found = vectors[ids.index(row[0].item.id)]
        tolerance = {"faiss-ivfpq": 0.1, "faiss-ivfsq": 0.01, "faiss-hnsw": 1e-3}.get(backend, 1e-4)
        assert row[0].score == pytest.approx(float(query @ found), abs=tolerance)


def test_vectors_are_normalised_in_one_place(filled: tuple[GalleryIndex, list[int], np.ndarray]) -> None:
    index, _, vectors = filled
    scaled = [index.search(vectors[:5] * scale, 5) for scale in (1.0, 37.5)]
    assert [[h.item.id for h in row] for row in scaled[0]] == [[h.item.id for h in row] for row in scaled[1]]
    assert [h.score for h in scaled[1][0]] == pytest.approx([h.score for h in scaled[0][0]], abs=1e-5)


def test_each_item_finds_itself(filled: tuple[GalleryIndex, list[int], np.ndarray], backend: str) -> None:
    index, ids, vectors = filled
    # PQ codes blur the tiny distances inside a tight cluster: there the item only has to be near the top.
    depth = 10 if backend == "faiss-ivfpq" else 1
    found = [
        item_id in {h.item.id for h in row}
        for item_id, row in zip(ids[:50], index.search(vectors[:50], depth), strict=True)
    ]
    assert np.mean(found) >= (0.9 if backend == "faiss-ivfpq" else 1.0)


def test_removed_items_leave_results_and_ids_are_not_reused(
    filled: tuple[GalleryIndex, list[int], np.ndarray],
) -> None:
    index, ids, vectors = filled
    gone = ids[:20]
    assert index.remove([*gone, 10**12]) == 20  # an unknown id is ignored
    assert len(index) == COUNT - 20
    assert index.items.get(gone[0]) is None
    found = {h.item.id for row in index.search(vectors[:20], 10) for h in row}
    assert not found & set(gone)
    new_ids = index.add(vectors[:2], entries(2, prefix="again"))
    assert not set(new_ids) & set(ids)
    index.save()
    assert len(index) == COUNT - 18 == index.manifest.count


def test_moved_items_keep_their_id_and_vector(filled: tuple[GalleryIndex, list[int], np.ndarray]) -> None:
    index, ids, vectors = filled
    assert index.move([Move(ids[3], "elsewhere/x.png", "elsewhere"), Move(10**12, "y.png", None)]) == 1
    item = index.items.get(ids[3])
    assert (item.path, item.label, item.content_hash) == (
        "elsewhere/x.png",
        "elsewhere",
        entries(COUNT)[3].content_hash,
    )
    assert index.items.get_by_path(entries(COUNT)[3].path) is None
    ((best, *_),) = index.search(vectors[3:4], 3)
    assert best.item.id == ids[3] and best.item.path == "elsewhere/x.png"


def test_saved_index_reopens_with_the_same_results(
    filled: tuple[GalleryIndex, list[int], np.ndarray], tmp_path: Path
) -> None:
    index, _, vectors = filled
    before = [[(h.item.id, round(h.score, 5)) for h in row] for row in index.search(vectors[:10], 5)]
    index.close()
    reopened = GalleryIndex.open(tmp_path / "index")
    after = [[(h.item.id, round(h.score, 5)) for h in row] for row in reopened.search(vectors[:10], 5)]
    assert after == before
    assert reopened.manifest.count == COUNT
    reopened.close()


def test_k_beyond_the_gallery_and_wrong_dimensions(make_index: MakeIndex) -> None:
    index = make_index()
    vectors = clustered_vectors(300, DIM)
    index.add(vectors, entries(300))
    index.save()
    hits = index.search(vectors[:2], 500)
    assert [len(row) for row in hits] == [300, 300]
    with pytest.raises(ValueError, match="dimension"):
        index.search(np.ones((1, DIM + 1), dtype=np.float32), 3)
    with pytest.raises(ValueError, match="dimension"):
        index.add(np.ones((1, DIM + 1), dtype=np.float32), entries(1, prefix="bad"))
    index.close()


def test_a_milvus_collection_from_before_capture_times_keeps_working(tmp_path: Path) -> None:
    """A collection made without the ``taken`` field: items are added and read without it, and date
    filters on when photos were taken use the time indexed (the backend leaves a collection's schema as
    it was made)."""
    import datetime as dt

    pymilvus = pytest.importorskip("pymilvus")
    pytest.importorskip("milvus_lite")
    from index.filters import ItemFilter
    from index.manifest import MILVUS_COLLECTION
    from index.milvus_backend import MODEL_PROPERTY

    directory = tmp_path / "index"
    directory.mkdir()
    client = pymilvus.MilvusClient(str(directory / "milvus.db"))
    schema = client.create_schema(auto_id=True, enable_dynamic_field=False)
    schema.add_field("id", pymilvus.DataType.INT64, is_primary=True)
    schema.add_field("vector", pymilvus.DataType.FLOAT_VECTOR, dim=DIM)
    schema.add_field("path", pymilvus.DataType.VARCHAR, max_length=4096)
    schema.add_field("label", pymilvus.DataType.VARCHAR, max_length=512, nullable=True)
    schema.add_field("content_hash", pymilvus.DataType.VARCHAR, max_length=64)
    schema.add_field("added", pymilvus.DataType.VARCHAR, max_length=40)
    index_params = client.prepare_index_params()
    index_params.add_index("vector", index_type="AUTOINDEX", metric_type="COSINE")
    client.create_collection(
        MILVUS_COLLECTION, schema=schema, index_params=index_params, properties={MODEL_PROPERTY: "model-a"}
    )
    client.close()

    index = GalleryIndex.create(
        directory, dim=DIM, model_fingerprint="model-a", gallery_root=None, backend="milvus"
    )
    try:
        assert index._backend.has_taken is False
        vectors = clustered_vectors(20, DIM)
        ids = index.add(vectors, entries(20, taken="2001-01-01T00:00:00"))
        index.save()
        assert index.items.get(ids[0]).taken is None and index.set_taken({ids[0]: "2001-01-01T00:00:00"}) == 0
        today = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(days=1)
        since = index.search(vectors[:2], 5, ItemFilter(taken_from=today))  # added today: found
        assert all(len(row) == 5 for row in since)
        assert index.search(vectors[:2], 5, ItemFilter(taken_to=today)) == [[], []]
    finally:
        index.close()


def test_an_index_refuses_another_model(
    filled: tuple[GalleryIndex, list[int], np.ndarray], backend: str, tmp_path: Path
) -> None:
    index, _, _ = filled
    with pytest.raises(IndexMismatchError, match="rebuild the index with this model"):
        index.check_model("model-b", DIM)
    with pytest.raises(IndexMismatchError, match="dimensions"):
        index.check_model("model-a", DIM + 1)
    if backend in MILVUS_BACKENDS:  # the collection itself records its model: another index may not use it
        manifest = index.manifest
        with pytest.raises(ValueError, match="holds vectors of model model-a"):
            GalleryIndex.create(
                tmp_path / "other",
                dim=DIM,
                model_fingerprint="model-b",
                gallery_root=None,
                backend="milvus",
                milvus=MilvusConnection(
                    manifest.milvus_uri or str(tmp_path / "index" / "milvus.db"), manifest.milvus_collection
                ),
            )


def test_scan_and_pages_walk_every_item_in_id_order_across_segments(make_index: MakeIndex) -> None:
    """Added in batches, each saved (sealed segments on a Milvus server): a scan yields every item once, in
    id order, and pages cut that order."""
    index = make_index()
    ids: list[int] = []
    for batch in range(4):
        ids += index.add(clustered_vectors(700, DIM, seed=batch), entries(700, prefix=f"batch{batch}"))
        index.save()
    assert [item.id for item in index.items.scan()] == sorted(ids)
    pages = [item.id for offset in range(0, 2800, 1000) for item in index.items.page(offset, 1000)]
    assert pages == sorted(ids)
    index.close()


def test_ids_given_by_the_client_rise_and_never_repeat() -> None:
    from index.milvus_backend import IdClock

    clock = IdClock()
    taken = [i for _ in range(2000) for i in clock.take(3)]
    assert taken == sorted(taken) and len(set(taken)) == len(taken) and 0 < taken[0] < 2**63
