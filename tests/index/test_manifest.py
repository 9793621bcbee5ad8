"""``manifest.json`` nests what was requested and what was built; format-2 manifests (flat) are still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from index.gallery import GalleryIndex
from index.manifest import FORMAT_VERSION, MANIFEST_NAME, DiskChange, Manifest
from index.selection import IndexOptions
from tests.support.vectors import clustered_vectors, entries

DIM = 16


def _index(directory: Path) -> GalleryIndex:
    index = GalleryIndex.create(
        directory,
        dim=DIM,
        model_fingerprint="m",
        gallery_root=None,
        options=IndexOptions("ivf", None, 0.9),
    )
    index.add(clustered_vectors(600, DIM), entries(600))
    index.save()
    return index


def _as_format_2(directory: Path) -> dict:
    """The manifest as format 2 wrote it: what was requested and built as top-level fields."""
    data = json.loads((directory / MANIFEST_NAME).read_text())
    requested, built = data.pop("requested"), data.pop("built")
    data.update(built)
    data.update(
        requested_index_type=requested["index_type"],
        memory_budget=requested["memory_budget"],
        target_recall=requested["target_recall"],
        format_version=2,
    )
    return data


def test_the_manifest_nests_what_was_requested_and_what_was_built(tmp_path: Path) -> None:
    index = _index(tmp_path / "index")
    queries = clustered_vectors(5, DIM, seed=9)
    hits = [[h.item.id for h in row] for row in index.search(queries, 5)]
    index.close()
    data = json.loads((tmp_path / "index" / MANIFEST_NAME).read_text())
    assert data["format_version"] == FORMAT_VERSION
    assert data["requested"] == {"index_type": "ivf", "memory_budget": None, "target_recall": 0.9}
    assert data["built"]["index_type"] == "ivf" and data["built"]["index_spec"].startswith("IVF")
    assert set(data["built"]["search_params"]) == {"nprobe"}
    assert data["built"]["tuned_count"] == 600
    assert "index_type" not in data and "requested_index_type" not in data

    # The same directory with its manifest written as format 2 opens with the same facts and answers alike.
    (tmp_path / "index" / MANIFEST_NAME).write_text(json.dumps(_as_format_2(tmp_path / "index")))
    old = Manifest.load(tmp_path / "index")
    assert old.requested.model_dump() == data["requested"] and old.built.model_dump() == data["built"]
    reopened = GalleryIndex.open(tmp_path / "index")
    assert [[h.item.id for h in row] for row in reopened.search(queries, 5)] == hits
    reopened.save()  # written back in the current format
    reopened.close()
    assert json.loads((tmp_path / "index" / MANIFEST_NAME).read_text())["format_version"] == FORMAT_VERSION


def test_an_unknown_format_is_refused(tmp_path: Path) -> None:
    _index(tmp_path / "index").close()
    path = tmp_path / "index" / MANIFEST_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 1}))
    with pytest.raises(ValueError, match="index format 1 is not supported"):
        Manifest.load(tmp_path / "index")


def test_disk_change_tells_a_save_from_another_index_at_the_path(tmp_path: Path) -> None:
    """The one answer the server, its reloader and the watcher act on, from the manifest's identity: two
    indexes created within one second differ, and a save of the same index is told from them."""
    served = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    assert served.disk_change() is DiskChange.UNCHANGED
    writer = GalleryIndex.open(tmp_path / "index")
    writer.add(clustered_vectors(5, DIM), entries(5))
    writer.save()
    assert served.disk_change() is DiskChange.SAVED
    assert writer.disk_change() is DiskChange.UNCHANGED  # its own save
    writer.close()

    GalleryIndex.create(tmp_path / "other", dim=DIM, model_fingerprint="m", gallery_root=None).close()
    other = Manifest.load(tmp_path / "other")
    other.created = served.manifest.created  # created within the same second
    other.save(tmp_path / "index")
    assert served.disk_change() is DiskChange.REPLACED
    (tmp_path / "index" / MANIFEST_NAME).write_text("not a manifest")
    assert served.disk_change() is DiskChange.REPLACED
    (tmp_path / "index" / MANIFEST_NAME).unlink()
    assert served.disk_change() is DiskChange.UNCHANGED  # nothing there to follow
    served.close()
