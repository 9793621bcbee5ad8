"""``dmlsearch index rebuild``: the same items re-embedded by a new model into a new index, resumable, with
the old index never written to."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.lib.images import make_image
from cli.main import app
from engine.build.rebuild import rebuild_index
from engine.model.embedder import Embedder
from index.gallery import GalleryIndex
from index.judgments import JudgedQuery
from index.manifest import Manifest
from tests.support.served import Served, copy_served, index_digest

runner = CliRunner()


def _invoke(*args: object) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _items(index: Path) -> list[tuple[int, str, str | None, str]]:
    gallery = GalleryIndex.open(index)
    try:
        return [(item.id, item.path, item.label, item.added) for item in gallery.items.scan()]
    finally:
        gallery.close()


def _snapshot(index: Path) -> tuple[dict[str, str], list[tuple[str, int]]]:
    """The index files' contents and every file's name and modification time."""
    return index_digest(index), sorted((p.name, p.stat().st_mtime_ns) for p in index.iterdir())


@pytest.fixture
def old(tmp_path: Path, demo_gallery: Path, demo_index: Path, exported_model: Path) -> Served:
    return copy_served(demo_gallery, demo_index, exported_model, tmp_path / "old")


def test_rebuild_re_embeds_the_same_items_with_the_new_model(
    old: Served, small_model: Path, tmp_path: Path
) -> None:
    # One item's file is gone, one changed (re-embedded under its id), one was added by the API earlier
    # under a label that is not its folder's name (kept).
    connection = sqlite3.connect(old.index / "items.sqlite")
    with connection:
        connection.execute("UPDATE items SET label = 'relabelled' WHERE id = 3")
    connection.close()
    before_items = _items(old.index)
    assert before_items[2][2] == "relabelled"
    gone, changed = before_items[0], before_items[1]
    (old.gallery / gone[1]).unlink()
    make_image(99).save(old.gallery / changed[1], format="PNG")
    before = _snapshot(old.index)
    new = tmp_path / "new"
    code, output = _invoke(
        "index", "rebuild", old.index, "--model", small_model, "--out", new, "--no-progress"
    )
    assert code == 0, output
    assert f"indexed {len(before_items) - 1} images into {new}" in output
    assert gone[1] in output  # listed as skipped
    assert _snapshot(old.index) == before, "the old index was written to"

    manifest, old_manifest = Manifest.load(new), Manifest.load(old.index)
    assert manifest.model_fingerprint == Embedder(small_model).fingerprint != old_manifest.model_fingerprint
    assert (manifest.dim, manifest.model_file, manifest.count) == (24, "model.onnx", len(before_items) - 1)
    assert manifest.gallery_root == old_manifest.gallery_root
    assert manifest.requested == old_manifest.requested
    assert _items(new) == before_items[1:]  # ids, paths, labels and times added
    new_index = GalleryIndex.open(new)  # each re-embedded item carries its new perceptual signature
    assert sorted(new_index.signatures()) == [item[0] for item in before_items[1:]]
    new_index.close()
    assert not list(tmp_path.glob(".new.*")), "staging directory left behind"

    image = old.gallery / before_items[5][1]
    code, output = _invoke("query", image, "--index", new, "-k", "1", "--json")  # the new index's own model
    assert code == 0, output
    (top,) = json.loads(output)["results"]
    assert (top["id"], top["path"]) == before_items[5][:2]


def test_a_killed_rebuild_continues_where_it_stopped(
    old: Served, small_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = Embedder(small_model, threads=1)
    calls = {"batches": 0}
    real_embed = embedder.embed_tensor

    def embed_then_die(batch: np.ndarray) -> object:
        calls["batches"] += 1
        if calls["batches"] == 3:
            raise KeyboardInterrupt  # the process is stopped after two committed batches
        return real_embed(batch)

    monkeypatch.setattr(embedder, "embed_tensor", embed_then_die)
    new = tmp_path / "new"
    with pytest.raises(KeyboardInterrupt):
        rebuild_index(old.index, embedder, new, batch_size=8, progress=False)
    assert not new.exists()  # only the staging directory holds the partial work
    monkeypatch.setattr(embedder, "embed_tensor", real_embed)
    report = rebuild_index(old.index, embedder, new, batch_size=8, progress=False)
    total = len(_items(old.index))
    assert report.unchanged == 16 and report.indexed == total - 16
    assert _items(new) == _items(old.index)

    fresh = tmp_path / "fresh"
    rebuild_index(old.index, embedder, fresh, batch_size=8, progress=False)
    probe = Embedder(small_model).embed([make_image(5)])
    for directory in (new, fresh):
        assert directory.joinpath("model.onnx").is_file()
    hits = [GalleryIndex.open(d).search(probe, 5) for d in (new, fresh)]
    assert [(h.item.id, round(h.score, 5)) for h in hits[0][0]] == [
        (h.item.id, round(h.score, 5)) for h in hits[1][0]
    ]


def test_rebuild_refuses_to_overwrite(old: Served, small_model: Path, tmp_path: Path) -> None:
    code, output = _invoke("index", "rebuild", old.index, "--model", small_model, "--out", old.index)
    assert code == 2 and "its own directory" in output
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    code, output = _invoke("index", "rebuild", old.index, "--model", small_model, "--out", taken)
    assert code == 2 and "not empty" in output
    code, output = _invoke(
        "index",
        "rebuild",
        old.index,
        "--model",
        small_model,
        "--out",
        tmp_path / "x",
        "--gallery",
        tmp_path / "no",
    )
    assert code == 2 and "does not exist" in output


def test_judgments_follow_their_items_into_the_rebuilt_index(
    old: Served, small_model: Path, exported_model: Path, tmp_path: Path
) -> None:
    index = GalleryIndex.open(old.index)
    ids = [item.id for item in index.items.scan()]
    fingerprint = index.manifest.model_fingerprint
    upload = JudgedQuery(content_hash="ab" * 32, embedding=np.ones(index.manifest.dim, np.float32))
    kept = [
        index.judgments.add(JudgedQuery(item=ids[1]), ids[2], 1, fingerprint, "2026-01-01T00:00:00+00:00"),
        index.judgments.add(upload, ids[3], -1, fingerprint, "2026-01-01T00:00:01+00:00"),
    ]
    index.judgments.add(JudgedQuery(item=ids[0]), ids[2], -1, fingerprint, "2026-01-01T00:00:02+00:00")
    gone = index.items.get(ids[0])
    index.close()
    assert gone is not None
    (old.gallery / gone.path).unlink()  # its item is skipped by the rebuild, and so is its judgment

    rebuild_index(old.index, Embedder(small_model), tmp_path / "other", progress=False)
    rebuild_index(old.index, Embedder(exported_model), tmp_path / "same", progress=False)
    other, same = GalleryIndex.open(tmp_path / "other"), GalleryIndex.open(tmp_path / "same")
    try:
        # Another model: the uploaded query's embedding is dropped, its hash and everything else kept.
        assert list(other.judgments.scan()) == kept
        assert next(iter(other.judgments.scan())).query.item == ids[1]
        assert [j.query.embedding is None for j in other.judgments.scan()] == [True, True]
        (_, by_upload) = same.judgments.scan()  # the same model keeps the embedding
        assert by_upload.query.embedding is not None and np.array_equal(
            by_upload.query.embedding, upload.embedding
        )
        assert by_upload.model_fingerprint == fingerprint
    finally:
        other.close()
        same.close()
