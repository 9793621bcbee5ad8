"""Filtered search (label, path prefix, time taken, time added) equals brute force over the subset."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pytest

from index.filters import ItemFilter, UnknownLabelError, clock_time, match_labels, stored_time
from index.gallery import GalleryIndex
from index.items import ItemStore
from index.protocol import Entry
from index.selection import IndexOptions
from tests.support.milvus_server import MILVUS_BACKENDS, MILVUS_PARAMS, milvus_target
from tests.support.vectors import clustered_vectors

DIM = 32
COUNT = 3000
K = 10
BACKENDS = ["faiss-flat", "faiss-hnsw", "faiss-ivf", "faiss-ivfsq", "faiss-ivfpq", *MILVUS_PARAMS]
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
    "taken, clock times with and without offsets": ItemFilter(
        taken_from=dt.datetime(2024, 6, 3, 12), taken_to=dt.datetime(2024, 6, 6)
    ),
    "taken on a day": ItemFilter(taken_from=dt.datetime(2024, 6, 2), taken_to=dt.datetime(2024, 6, 3)),
    "taken and added": ItemFilter(taken_from=dt.datetime(2024, 6, 5), added_to=DAY0 + dt.timedelta(days=5)),
    "nothing matches": ItemFilter(taken_to=dt.datetime(2000, 1, 1)),
}
TAKEN0 = dt.datetime(2024, 6, 1)
OFFSETS = ["", "+09:00", "-05:00"]  # a camera that wrote no offset, one in Tokyo, one in New York


def metadata(i: int) -> tuple[Entry, dt.datetime]:
    """Item ``i``'s entry (20 labels, 4 folders, taken over 7 days every 5 hours) and time added (10 days)."""
    folder = ["folder_0", "folder_1", "folder_1x", "folder_2"][i % 4]
    clock = TAKEN0 + dt.timedelta(hours=(5 * i) % (7 * 24))
    taken = clock.isoformat() + OFFSETS[i % 3]
    entry = Entry(f"{folder}/{i:05d}.png", f"label{i % 20:02d}", f"hash-{i}", taken)
    return entry, DAY0 + dt.timedelta(days=i % 10)


def matches(where: ItemFilter, i: int) -> bool:
    entry, added = metadata(i)
    utc = lambda t: t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t  # noqa: E731
    clock = dt.datetime.fromisoformat(entry.taken).replace(tzinfo=None)  # the camera's clock, offset aside
    return (
        (not where.labels or entry.label in where.labels)
        and (where.path_prefix is None or entry.path.startswith(where.path_prefix))
        and (where.added_from is None or added >= utc(where.added_from))
        and (where.added_to is None or added < utc(where.added_to))
        and (where.taken_from is None or clock >= where.taken_from)
        and (where.taken_to is None or clock < where.taken_to)
    )


@pytest.fixture(scope="module", params=BACKENDS)
def filled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    backend = request.param
    directory = tmp_path_factory.mktemp("filtered") / "index"
    if backend in MILVUS_BACKENDS:
        target = milvus_target(backend, request, directory)
        index = GalleryIndex.create(directory, dim=DIM, model_fingerprint="m", gallery_root=None, **target)
    else:
        options = IndexOptions(backend.removeprefix("faiss-"), target_recall=0.95)
        index = GalleryIndex.create(
            directory, dim=DIM, model_fingerprint="m", gallery_root=None, options=options
        )
    vectors = clustered_vectors(COUNT, DIM, clusters=20, spread=0.5)
    rows = [metadata(i) for i in range(COUNT)]
    ids = np.zeros(COUNT, dtype=np.int64)
    # Each day's items are added while the clock every backend stamps items with reads that day.
    for day in sorted({added for _, added in rows}):
        today = [i for i, (_, added) in enumerate(rows) if added == day]
        with pytest.MonkeyPatch.context() as clock:
            for module in ("index.items", "index.milvus_backend"):
                clock.setattr(f"{module}.now_utc", lambda day=day: stored_time(day), raising=False)
            ids[today] = index.add(vectors[today], [rows[i][0] for i in today])
    index.save()
    yield backend, index, ids, vectors
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
    assert ItemFilter(taken_from=dt.datetime(2024, 6, 2), taken_to=dt.datetime(2024, 6, 1)).empty_range
    with pytest.raises(ValueError, match=r"camera's clock.*without a zone"):
        ItemFilter(taken_from=DAY0)
    assert clock_time(dt.datetime(2024, 6, 1)) == "2024-06-01T00:00:00"
    assert ItemFilter().empty and not ItemFilter(labels=("a",)).empty


def test_an_empty_filter_searches_everything(filled) -> None:
    _, index, _, vectors = filled
    plain = [[hit.item.id for hit in row] for row in index.search(vectors[:5], K)]
    assert [[hit.item.id for hit in row] for row in index.search(vectors[:5], K, ItemFilter())] == plain


def test_an_index_from_before_capture_times_gains_them_and_dates_by_time_indexed_meanwhile(tmp_path) -> None:
    """An items.sqlite without ``taken`` is migrated when opened for writing; its items, undated, are
    found by the time they were indexed until a build dates them."""
    import sqlite3

    directory = tmp_path / "old"
    directory.mkdir()
    connection = sqlite3.connect(directory / ItemStore.FILE_NAME)
    with connection:  # the schema before capture times were kept
        connection.execute(
            "CREATE TABLE items (id INTEGER PRIMARY KEY AUTOINCREMENT, path TEXT NOT NULL UNIQUE, "
            "label TEXT, content_hash TEXT NOT NULL, added TEXT NOT NULL)"
        )
        connection.execute("CREATE TABLE vectors (id INTEGER PRIMARY KEY, vector BLOB NOT NULL)")
        connection.executemany(
            "INSERT INTO items (path, label, content_hash, added) VALUES (?, ?, ?, ?)",
            [
                ("a.jpg", None, "h1", "2025-01-01T10:00:00+00:00"),
                ("b.jpg", None, "h2", "2025-03-01T10:00:00+00:00"),
            ],
        )
    connection.close()
    old = ItemStore(directory, DIM, read_only=True)  # read-only: no migration, and no taken
    assert [item.taken for item in old.scan()] == [None, None]
    old.close()
    store = ItemStore(directory, DIM)
    since_february = ItemFilter(taken_from=dt.datetime(2025, 2, 1))
    assert store.matching_ids(since_february).tolist() == [2]  # the time indexed stands in
    assert store.set_taken({1: "2024-06-01T08:00:00+02:00", 2: "2024-05-01T08:00:00"}) == 2
    assert store.matching_ids(since_february).tolist() == []
    assert store.matching_ids(ItemFilter(taken_from=dt.datetime(2024, 6, 1))).tolist() == [1]
    assert store.get(1).taken == "2024-06-01T08:00:00+02:00"
    condition, values = since_february.sql()
    plan = store.connection.execute(f"EXPLAIN QUERY PLAN SELECT id FROM items WHERE {condition}", values)
    assert "items_by_taken" in str(plan.fetchall())
    store.close()


def test_labels_match_whatever_their_case_and_an_unknown_label_names_the_known_ones(filled) -> None:
    _, index, _, vectors = filled
    exact = [[hit.item.id for hit in row] for row in index.search(vectors[:3], K, ItemFilter(("label03",)))]
    for spelling in ("LABEL03", "Label03", "label03"):
        found = index.search(vectors[:3], K, ItemFilter((spelling,)))
        assert [[hit.item.id for hit in row] for row in found] == exact
    with pytest.raises(UnknownLabelError, match=r"'label3'.*the labels are: label00, label01,.* label19"):
        index.search(vectors[:1], K, ItemFilter(("label03", "label3")))


def test_label_matching() -> None:
    known = ["hummer", "Hummer", "Straße", "bmw"]
    assert match_labels(["HUMMER"], known) == ("Hummer", "hummer")  # both folders
    assert match_labels(["STRASSE"], known) == ("Straße",)  # Unicode case folding, not ASCII lower()
    assert match_labels(["Cafe\u0301"], ["Café"]) == ("Café",)  # NFD typed, NFC stored
    with pytest.raises(UnknownLabelError, match="no item has a label"):
        match_labels(["x"], [])
    many = [f"l{i:03d}" for i in range(100)]
    with pytest.raises(UnknownLabelError, match="l029 and 70 more"):
        match_labels(["x"], many)


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
    store.add(vectors, [Entry(inside, None, "h1"), Entry(outside, None, "h2")])
    condition, values = ItemFilter(path_prefix=prefix).sql()
    rows = store.connection.execute(f"SELECT path FROM items WHERE {condition}", values).fetchall()
    assert [path for (path,) in rows] == [inside]
