"""The index commands: build-index options, index add/remove/stats/merge, and the Milvus backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.lib.images import make_image
from bench.lib.servers import free_port
from cli.main import app
from engine.model.model_card import ModelCard
from foundation.defaults import TRASH_FOLDER
from index.gallery import GalleryIndex
from index.judgments import JudgedQuery
from index.manifest import Manifest
from tests.support.milvus_server import MILVUS_PARAMS, MilvusServerProcess, milvus_target

runner = CliRunner()


def _run(*args: object) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def _fails(*args: object) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    return result.output


def _query(index: Path, model: Path, image: Path) -> list[tuple[int, str, float]]:
    body = json.loads(_run("query", image, "--index", index, "--model", model, "-k", "5", "--json"))
    return [(r["id"], r["path"], round(r["score"], 5)) for r in body["results"]]


def test_build_index_options_and_stats(exported_model: Path, synthetic_gallery: Path, tmp_path: Path) -> None:
    out = tmp_path / "index"
    output = _run(
        "build-index",
        synthetic_gallery,
        "--out",
        out,
        "--model",
        exported_model,
        "--index-type",
        "hnsw",
        "--target-recall",
        "0.9",
        "--memory-budget",
        "64MB",
        "--no-progress",
    )
    assert "indexed 9 images" in output and "faiss index hnsw [IDMap2,HNSW32_SQfp16]" in output
    stats = json.loads(_run("index", "stats", out, "--json"))
    assert (stats["index_type"], stats["count"], stats["indexed_vectors"]) == ("hnsw", 9, 9)
    assert stats["memory_budget"] == 64 * 1024**2 and stats["target_recall"] == 0.9
    assert {"manifest.json", "vectors.faiss", "items.sqlite"} <= set(stats["files"])
    assert "index_type: hnsw" in _run("index", "stats", out)
    assert "indexed 0 images" in _run(
        "build-index", synthetic_gallery, "--out", out, "--model", exported_model
    )
    _run("build-index", synthetic_gallery, "--out", out, "--model", exported_model, "--memory-budget", "none")
    lifted = json.loads(_run("index", "stats", out, "--json"))
    assert (lifted["memory_budget"], lifted["target_recall"]) == (None, 0.9)  # only the budget changed


def test_bad_options_are_clear_errors(exported_model: Path, synthetic_gallery: Path, tmp_path: Path) -> None:
    build = ("build-index", synthetic_gallery, "--out", tmp_path / "i", "--model", exported_model)
    assert "cannot read 'lots'" in _fails(*build, "--memory-budget", "lots")
    assert "does not exist" in _fails(*build, "--shard", "2/2")
    assert "at least 256 vectors" in _fails(*build, "--index-type", "ivfpq")
    assert "too small" in _fails(*build, "--index-type", "flat", "--memory-budget", "1k")
    assert _fails(*build, "--index-type", "lsh")
    assert "--decode-cpu-seconds" in _fails(*build, "--decode-cpu-seconds", "0")
    assert "not an index directory" in _fails("index", "stats", tmp_path)


def test_index_add_and_remove(exported_model: Path, synthetic_gallery: Path, tmp_path: Path) -> None:
    out = tmp_path / "index"
    _run("build-index", synthetic_gallery, "--out", out, "--model", exported_model, "--no-progress")
    new = synthetic_gallery / "alpha" / "new.png"
    make_image(4242).save(new)
    assert "indexed 1 images" in _run("index", "add", out, new, "--model", exported_model, "--no-progress")
    assert _query(out, exported_model, new)[0][1] == "alpha/new.png"

    index = GalleryIndex.open(out)
    gamma_id = index.items.get_by_path("gamma/gamma_0.png").id
    index.close()
    query = tmp_path / "query.png"  # the gallery file is set aside by the remove
    query.write_bytes(new.read_bytes())
    output = _run("index", "remove", out, "alpha/new.png", "--id", gamma_id)
    assert "removed 2 items; 8 remain" in output
    assert "alpha/new.png" not in {p for _, p, _ in _query(out, exported_model, query)}
    assert "no item with path nope.png" in _fails("index", "remove", out, "nope.png")
    assert "no items with ids 999" in _fails("index", "remove", out, "--id", 999)
    assert "name the items" in _fails("index", "remove", out)
    assert "outside the index's gallery folder" in _fails(
        "index", "add", out, exported_model, "--model", exported_model
    )


def test_two_shards_merge_into_what_one_process_builds(
    exported_model: Path, synthetic_gallery: Path, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    _run("build-index", synthetic_gallery, "--out", whole, "--model", exported_model, "--no-progress")
    shards = [tmp_path / f"shard{i}" for i in range(2)]
    for number, shard in enumerate(shards):
        output = _run(
            "build-index",
            synthetic_gallery,
            "--out",
            shard,
            "--model",
            exported_model,
            "--shard",
            f"{number}/2",
            "--no-progress",
        )
        # A shard has no search index of its own (not "faiss index none").
        assert f"faiss shard {number}/2, " in output and "searchable once merged" in output
        assert "index none" not in output
    assert "combine the shards" in _fails(
        "query", synthetic_gallery / "alpha" / "alpha_0.png", "--index", shards[0], "--model", exported_model
    )
    merged = tmp_path / "merged"
    assert "merged 2 shards" in _run("index", "merge", *shards, "--out", merged, "--no-progress")
    for image in ("alpha/alpha_1.png", "gamma/gamma_2.png"):
        assert _query(merged, exported_model, synthetic_gallery / image) == _query(
            whole, exported_model, synthetic_gallery / image
        )
    a, b = (Manifest.load(d) for d in (merged, whole))
    assert (a.count, a.built.index_spec, a.built.search_params) == (
        b.count,
        b.built.index_spec,
        b.built.search_params,
    )
    assert a.model_file == "model.onnx"  # the merged index carries the shards' model
    image = synthetic_gallery / "beta" / "beta_0.png"
    no_model = json.loads(_run("query", image, "--index", merged, "-k", "5", "--json"))["results"]
    assert [(r["id"], r["path"], round(r["score"], 5)) for r in no_model] == _query(
        merged, exported_model, image
    )


def _paths_and_ids(out: Path) -> dict[str, int]:
    index = GalleryIndex.open(out)
    try:
        return {item.path: item.id for item in index.items.scan()}
    finally:
        index.close()


@pytest.mark.parametrize("engine", ["faiss", *MILVUS_PARAMS])
def test_index_remove_lasts_through_build_index_and_is_undone(
    engine: str, exported_model: Path, synthetic_gallery: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Issue 42, finding 2: ``index remove`` then ``build-index`` of the same folder into the same index
    brought the items back. Now their files, a byte copy's included, are set aside; the undo restores them
    (under their ids and with their judgments where the index takes ids, re-embedded on Milvus); a photo
    put back into the folder by hand is indexed again."""
    out = tmp_path / "index"
    where: list[str] = []
    if engine != "faiss":
        target = milvus_target(engine, request, out)
        where = ["--backend", "milvus"]
        if (milvus := target.get("milvus")) is not None:
            where += [f"--milvus-uri={milvus.uri}", f"--milvus-collection={milvus.collection}"]
    (synthetic_gallery / "copies").mkdir()
    copy = synthetic_gallery / "copies" / "again.png"
    copy.write_bytes((synthetic_gallery / "alpha" / "alpha_0.png").read_bytes())
    build = ["build-index", synthetic_gallery, "--out", out, "--model", exported_model, "--no-progress"]
    assert "indexed 9 images" in _run(*build, *where)
    before = _paths_and_ids(out)
    index = GalleryIndex.open(out)
    judgment = index.judgments.add(
        JudgedQuery(item=before["beta/beta_0.png"]),
        before["gamma/gamma_0.png"],
        1,
        "m",
        "2026-01-01T00:00:00",
    )
    index.close()

    output = _run("index", "remove", out, "alpha/alpha_0.png", "--id", before["gamma/gamma_0.png"])
    assert "removed 2 items; 7 remain" in output
    for path in ("alpha/alpha_0.png", "copies/again.png", "gamma/gamma_0.png"):
        assert f"set aside {path}" in output and not (synthetic_gallery / path).exists()
    plan_id = output.split("--undo ")[-1].strip()
    assert (synthetic_gallery / TRASH_FOLDER / plan_id / "gamma/gamma_0.png").is_file()

    assert "indexed 0 images" in _run(*build)  # what brought them back
    assert set(_paths_and_ids(out)) == set(before) - {"alpha/alpha_0.png", "gamma/gamma_0.png"}
    index = GalleryIndex.open(out)
    assert list(index.judgments.scan()) == []  # deleted with its result
    index.close()

    undone = _run("duplicates", "--index", out, "--undo", plan_id)
    after = _paths_and_ids(out)
    assert set(after) == set(before) and copy.is_file()
    index = GalleryIndex.open(out)
    if engine == "faiss":  # ids given back, and the judgment with them
        assert "put back 3 images (0 were already in place), 2 items under their ids" in undone
        assert after == before and list(index.judgments.scan()) == [judgment]
    else:  # Milvus takes no ids: indexed again
        assert "indexed 2 again" in undone
    index.close()
    assert "indexed 0 images" in _run(*build)

    output = _run("index", "remove", out, "gamma/gamma_0.png")  # then put back by hand, on purpose
    trashed = synthetic_gallery / TRASH_FOLDER / output.split("--undo ")[-1].strip() / "gamma/gamma_0.png"
    (synthetic_gallery / "gamma" / "back.png").write_bytes(trashed.read_bytes())
    assert "indexed 1 images" in _run(*build)
    assert "gamma/back.png" in _paths_and_ids(out)


@pytest.mark.parametrize("engine", MILVUS_PARAMS)
def test_milvus_backend_end_to_end(
    engine: str,
    exported_model: Path,
    synthetic_gallery: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = tmp_path / "index"
    target = milvus_target(engine, request, out)
    where = []
    if (milvus := target.get("milvus")) is not None:  # the real server's: its address and a collection
        where = [f"--milvus-uri={milvus.uri}", f"--milvus-collection={milvus.collection}"]
    make_image(555).save(synthetic_gallery / "loose.png")  # directly in the folder: no label
    output = _run(
        "build-index",
        synthetic_gallery,
        "--out",
        out,
        "--model",
        exported_model,
        "--backend",
        "milvus",
        *where,
        "--no-progress",
    )
    assert "indexed 10 images" in output and "milvus index AUTOINDEX" in output
    if engine == "milvus-lite":
        assert (out / "milvus.db").exists()  # Milvus Lite inside the index directory by default
    index = GalleryIndex.open(out)
    assert index.items.get_by_path("loose.png").label is None  # not "": no label
    assert index.items.get_by_path("beta/beta_0.png").label == "beta"
    index.close()
    query = tmp_path / "query.png"  # the gallery file is set aside by the remove below
    query.write_bytes((synthetic_gallery / "beta" / "beta_2.png").read_bytes())
    top = _query(out, exported_model, query)[0]
    assert top[1] == "beta/beta_2.png" and top[2] == pytest.approx(1.0, abs=1e-4)
    assert "indexed 0 images" in _run(
        "build-index", synthetic_gallery, "--out", out, "--model", exported_model, "--no-progress"
    )
    # A Milvus collection keeps no perceptual signatures: the summary does not claim it used them.
    summary = _run("duplicates", "--index", out).splitlines()[-1]
    assert "by cosine alone" in summary and "within 4 bits" not in summary
    # Milvus Lite has no server timestamps: pymilvus's warning about them is not shown.
    assert not [record for record in caplog.records if "mvccTs" in record.getMessage()]
    assert "removed 1 items; 9 remain" in _run("index", "remove", out, "beta/beta_2.png")
    assert "beta/beta_2.png" not in {p for _, p, _ in _query(out, exported_model, query)}
    assert json.loads(_run("index", "stats", out, "--json"))["backend"] == "milvus"
    assert "is a milvus index" in _fails(
        "build-index", synthetic_gallery, "--out", out, "--model", exported_model, "--backend", "faiss"
    )


def test_build_index_says_what_moved_what_changed_model_and_what_another_folder_would_lose(
    exported_model: Path, small_model: Path, synthetic_gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    _run("build-index", synthetic_gallery, "--model", small_model, "--out", out, "--no-progress")
    before = {item_id for item_id, _, _ in _ids(out)}
    (synthetic_gallery / "alpha" / "alpha_0.png").rename(synthetic_gallery / "alpha" / "first.png")
    (synthetic_gallery / "delta").mkdir()
    (synthetic_gallery / "beta" / "beta_1.png").rename(synthetic_gallery / "delta" / "beta_1.png")

    output = _run("build-index", synthetic_gallery, "--out", out, "--no-progress")
    assert "indexed 0 images into" in output and "(7 unchanged, 2 moved, 0 removed)" in output
    assert "moved or renamed (2, 1 to another label):" in output
    assert "  alpha/alpha_0.png -> alpha/first.png\n" in output
    assert "  beta/beta_1.png -> delta/beta_1.png (label beta -> delta)\n" in output

    # Another model into the same directory: the items keep their ids, and it says so.
    output = _run("build-index", synthetic_gallery, "--model", exported_model, "--out", out, "--no-progress")
    assert "its 9 items were re-embedded under their ids" in output
    assert {item_id for item_id, _, _ in _ids(out)} == before
    assert Manifest.load(out).model_fingerprint == ModelCard.load(exported_model).fingerprint

    other = tmp_path / "demo"
    other.mkdir()
    make_image(5).save(other / "a.png")
    output = _fails("build-index", other, "--out", out, "--no-progress")
    assert f"indexes the folder {synthetic_gallery.resolve()}" in output
    assert "9 of its 9 items are not at the same paths" in output
    assert len(_ids(out)) == 9
    output = _run("build-index", other, "--out", out, "--replace", "--no-progress")
    assert "(0 unchanged, 0 moved, 9 removed)" in output


def _ids(index_dir: Path) -> list[tuple[int, str, str | None]]:
    index = GalleryIndex.open(index_dir)
    try:
        return [(item.id, item.path, item.label) for item in index.items.scan()]
    finally:
        index.close()


def test_an_unreachable_milvus_server_is_reported_as_such(
    exported_model: Path, synthetic_gallery: Path, tmp_path: Path
) -> None:
    pytest.importorskip("pymilvus")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    output = _fails(
        "build-index", synthetic_gallery, "--out", tmp_path / "index", "--model", exported_model,
        "--backend", "milvus", "--milvus-uri", uri, "--no-progress",
    )  # fmt: skip
    assert f"error: Milvus at {uri}:" in output and "decoded" not in output


def test_a_write_the_milvus_server_refuses_is_reported_with_its_message(
    exported_model: Path, synthetic_gallery: Path, tmp_path: Path, milvus_server: MilvusServerProcess
) -> None:
    """The server takes the collection but refuses every insert (labels longer than its field): the build
    fails with the server's message, not as "none of the files could be decoded"."""
    from pymilvus import DataType, MilvusClient

    from index.milvus_backend import MODEL_PROPERTY

    card = ModelCard.load(exported_model)
    client = MilvusClient(milvus_server.uri, timeout=10)
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=card.embedding_dim)
    schema.add_field("path", DataType.VARCHAR, max_length=4096)
    schema.add_field("label", DataType.VARCHAR, max_length=2)  # "alpha" does not fit
    schema.add_field("content_hash", DataType.VARCHAR, max_length=64)
    schema.add_field("added", DataType.VARCHAR, max_length=40)
    index_params = client.prepare_index_params()
    index_params.add_index("vector", index_type="FLAT", metric_type="COSINE")
    collection = f"narrow_{free_port()}"
    client.create_collection(
        collection, schema=schema, index_params=index_params, properties={MODEL_PROPERTY: card.fingerprint}
    )
    try:
        output = _fails(
            "build-index", synthetic_gallery, "--out", tmp_path / "index", "--model", exported_model,
            "--backend", "milvus", "--milvus-uri", milvus_server.uri, "--milvus-collection", collection,
            "--no-progress",
        )  # fmt: skip
    finally:
        client.drop_collection(collection)
        client.close()
    assert f"error: Milvus at {milvus_server.uri}:" in output and "max length" in output
    assert "decoded" not in output


def test_index_commands_take_the_index_as_an_argument_or_with_index(
    small_model: Path, synthetic_gallery: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    _run("build-index", synthetic_gallery, "--out", out, "--model", small_model, "--no-progress")
    as_argument = _run("index", "stats", out, "--json")
    assert _run("index", "stats", "--index", out, "--json") == as_argument
    assert "the index is given twice" in _fails("index", "stats", out, "--index", out)
    assert "name the index: --index DIR" in _fails("index", "stats")
    removed = _run("index", "remove", "--index", out, "alpha/alpha_0.png")
    assert "removed 1 items; 8 remain" in removed
    trash = synthetic_gallery / TRASH_FOLDER / removed.split("--undo ")[-1].strip()
    (trash / "alpha" / "alpha_0.png").rename(synthetic_gallery / "alpha" / "alpha_0.png")  # put back by hand
    added = _run("index", "add", "--index", out, synthetic_gallery / "alpha" / "alpha_0.png", "--no-progress")
    assert "indexed 1 images" in added
    assert "name the images to add" in _fails("index", "add", out)
    rebuilt = tmp_path / "rebuilt"
    _run("index", "rebuild", "--index", out, "--model", small_model, "--out", rebuilt, "--no-progress")
    assert json.loads(_run("index", "stats", rebuilt, "--json"))["count"] == 9
