"""Filtered search (label, path prefix, time added) equals brute force over the filtered subset."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pytest

from index.filters import ItemFilter, stored_time
from index.gallery import GalleryIndex
from index.items import ItemStore
from index.selection import IndexOptions
from tests.helpers import clustered_vectors

DIM = 32
COUNT = 3000
K = 10
BACKENDS = ["faiss-flat", "faiss-hnsw", "faiss-ivf", "faiss-ivfsq", "faiss-ivfpq", "milvus-lite"]
# recall@10 against brute force over the subset (flat: the same results).
MIN_RECALL = {"faiss-ivfpq": 0.5}
DEFAULT_MIN_RECALL = 0.9
DAY0 = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
FILTERS = {
    "one label": ItemFilter(labels=("label03",)),
    "two labels": ItemFilter(labels=("label03", "label11")),
    "sub-folder": ItemFilter(path_prefix="folder_2/"),
    "prefix with an underscore": ItemFilter(path_prefix="folder_1"),  # folder_1/ and folder_1x/, not a LIKE
    "dates": ItemFilter(added_from=DAY0 + dt.timedelta(days=3), added_to=DAY0 + dt.timedelta(days=5)),
    "naive dates are UTC": ItemFilter(added_from=dt.datetime(2025, 1, 7)),
    "all together": ItemFilter(
        labels=("label01", "label02", "label05"), path_prefix="folder_", added_to=DAY0 + dt.timedelta(days=8)
    ),
    "nothing matches": ItemFilter(labels=("no such label",)),
}


def metadata(i: int) -> tuple[str, str, str, dt.datetime]:
    """path, label, content hash and time added of item ``i``: 20 labels, 4 folders, 10 days."""
    folder = ["folder_0", "folder_1", "folder_1x", "folder_2"][i % 4]
    return f"{folder}/{i:05d}.png", f"label{i % 20:02d}", f"hash-{i}", DAY0 + dt.timedelta(days=i % 10)


def matches(where: ItemFilter, i: int) -> bool:
    path, label, _, added = metadata(i)
    utc = lambda t: t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t  # noqa: E731
    return (
        (not where.labels or label in where.labels)
        and (where.path_prefix is None or path.startswith(where.path_prefix))
        and (where.added_from is None or added >= utc(where.added_from))
        and (where.added_to is None or added < utc(where.added_to))
    )


@pytest.fixture(scope="module", params=BACKENDS)
def filled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    backend = request.param
    directory = tmp_path_factory.mktemp("filtered") / "index"
    if backend == "milvus-lite":
        pytest.importorskip("pymilvus")
        pytest.importorskip("milvus_lite")
        index = GalleryIndex.create(
            directory, dim=DIM, model_fingerprint="m", gallery_root=None, backend="milvus"
        )
    else:
        options = IndexOptions(backend.removeprefix("faiss-"), target_recall=0.95)
        index = GalleryIndex.create(
            directory, dim=DIM, model_fingerprint="m", gallery_root=None, options=options
        )
    vectors = clustered_vectors(COUNT, DIM, clusters=20, spread=0.5)
    rows = [metadata(i) for i in range(COUNT)]
    ids = index.add(vectors, [(path, label, content) for path, label, content, _ in rows])
    times = [stored_time(added) for *_, added in rows]
    if backend == "milvus-lite":
        index.backend.client.upsert(
            index.backend.collection,
            [{"id": i, "added": t} for i, t in zip(ids, times, strict=True)],
            partial_update=True,
        )
    else:
        with index.items.connection as connection:
            connection.executemany(
                "UPDATE items SET added = ? WHERE id = ?", list(zip(times, ids, strict=True))
            )
    index.save()
    yield backend, index, np.array(ids), vectors
    index.close()


@pytest.mark.parametrize("name", list(FILTERS))
def test_filtered_results_equal_brute_force_over_the_subset(filled, name: str) -> None:
    backend, index, ids, vectors = filled
    where = FILTERS[name]
    keep = np.array([matches(where, i) for i in range(COUNT)])
    queries = vectors[:: COUNT // 25][:25] + 0.05
    hits = index.search(queries, K, where)
    if not keep.any():
        assert all(row == [] for row in hits)
        return
    subset_ids, subset = ids[keep], vectors[keep]
    exact = subset_ids[
        np.argsort(-(queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ subset.T, axis=1)
    ]
    exact = exact[:, :K]
    recalls = []
    for row, truth in zip(hits, exact, strict=True):
        found = [hit.item.id for hit in row]
        assert len(found) == min(K, keep.sum())
        assert set(found) <= set(subset_ids.tolist()), "a result outside the filter"
        assert [hit.score for hit in row] == sorted((hit.score for hit in row), reverse=True)
        recalls.append(len(set(found) & set(truth.tolist())) / len(truth))
    if backend == "faiss-flat":
        assert [[hit.item.id for hit in row] for row in hits] == exact.tolist()
    else:
        assert np.mean(recalls) >= MIN_RECALL.get(backend, DEFAULT_MIN_RECALL), recalls


def test_filters_are_validated() -> None:
    for outside in ("/etc", "../photos", "./", "a/../../b"):
        with pytest.raises(ValueError, match="in the gallery folder"):
            ItemFilter(path_prefix=outside)
    assert ItemFilter(path_prefix="././camera/").path_prefix == "camera/"
    assert ItemFilter(added_from=DAY0, added_to=DAY0).empty_range
    assert not ItemFilter(added_from=DAY0, added_to=DAY0 + dt.timedelta(seconds=1)).empty_range
    assert ItemFilter().empty and not ItemFilter(labels=("a",)).empty


def test_an_empty_filter_searches_everything(filled) -> None:
    _, index, _, vectors = filled
    plain = [[hit.item.id for hit in row] for row in index.search(vectors[:5], K)]
    assert [[hit.item.id for hit in row] for row in index.search(vectors[:5], K, ItemFilter())] == plain


@pytest.mark.parametrize(
    ("prefix", "inside", "outside"),
    [
        ("a\U0010ffff", "a\U0010ffff/x.jpg", "b"),
        ("a\ud7ff", "a\ud7ff.jpg", "a\ue000"),
        ("\U0010ffff", "\U0010ffff\U0010ffff", "\U0010fffe"),
    ],
)
def test_prefix_ranges_at_the_ends_of_unicode(tmp_path: Path, prefix: str, inside: str, outside: str) -> None:
    """The range's upper end steps over the surrogates and past the last code point (both were errors)."""
    store = ItemStore(tmp_path, 2)
    vectors = np.eye(2, dtype=np.float32)
    store.add(vectors, [(inside, None, "h1"), (outside, None, "h2")])
    condition, values = ItemFilter(path_prefix=prefix).sql()
    rows = store.connection.execute(f"SELECT path FROM items WHERE {condition}", values).fetchall()
    assert [path for (path,) in rows] == [inside]
