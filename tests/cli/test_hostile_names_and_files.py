"""Gallery, index and model names as an attacker leaves them (issue 43, classes 6 and 7): a FIFO, a device
or a folder where a file is read is refused at once (never waited on); a file name that is not UTF-8 is
indexed, watched, searched and served, and shown with backslash escapes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.lib.images import make_image
from cli.main import app
from index.gallery import GalleryIndex
from tests.support.apps import app_clients
from tests.support.servers import API_KEY
from tests.support.waiting import wait_until

LATIN1_FILE = os.fsdecode(b"caf\xe9.png")  # a Latin-1 name from an old zip file: not UTF-8
LATIN1_FOLDER = os.fsdecode(b"pr\xeats")
MIXED = os.fsdecode("naïve".encode() + b"\xff.png")  # valid UTF-8 and a byte that is not
AT_ONCE = 10.0  # seconds: a refusal, not a wait (a FIFO would block for ever)
runner = CliRunner()


def _gallery(root: Path) -> Path:
    (root / "cats").mkdir(parents=True)
    (root / LATIN1_FOLDER).mkdir()
    for i, name in enumerate(("0.png", LATIN1_FILE, MIXED)):
        make_image(i, size=(64, 56)).save(root / "cats" / name)
    make_image(9, size=(64, 56)).save(root / LATIN1_FOLDER / "1.png")
    return root


def _build(gallery: Path, index: Path, model: Path) -> None:
    result = runner.invoke(app, ["build-index", str(gallery), "--out", str(index), "--model", str(model)])
    assert result.exit_code == 0, result.output


def _paths(index_dir: Path) -> dict[str, int]:
    index = GalleryIndex.open(index_dir, read_only=True)
    try:
        return {item.path: item.id for item in index.items.scan()}
    finally:
        index.close()


@pytest.fixture
def built(tmp_path: Path, small_model: Path) -> Iterator[tuple[Path, Path, Path]]:
    gallery, index = _gallery(tmp_path / "gallery"), tmp_path / "index"
    _build(gallery, index, small_model)
    yield gallery, index, small_model


def test_build_index_keeps_names_that_are_not_utf8(built: tuple[Path, Path, Path]) -> None:
    gallery, index, model = built
    paths = _paths(index)
    # The stored name opens the very file (the bytes kept), and a rebuild finds every file unchanged.
    assert {f"cats/{LATIN1_FILE}", f"cats/{MIXED}", f"{LATIN1_FOLDER}/1.png"} <= set(paths)
    for path in paths:
        assert (gallery / path).is_file()
    again = runner.invoke(app, ["build-index", str(gallery), "--out", str(index), "--model", str(model)])
    assert again.exit_code == 0, again.output
    assert "(4 unchanged" in again.output


def test_query_shows_a_name_that_is_not_utf8_escaped(built: tuple[Path, Path, Path]) -> None:
    gallery, index, _ = built
    result = runner.invoke(
        app, ["query", str(gallery / "cats" / LATIN1_FILE), "--index", str(index), "-k", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "cats/caf\\xe9.png" in result.output
    assert "cats/naïve\\xff.png" in result.output
    assert "pr\\xeats" in result.output  # the folder's label
    as_json = runner.invoke(app, ["query", str(gallery / "cats" / MIXED), "--index", str(index), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert '"path": "cats/na\\u00efve\\\\xff.png"' in as_json.output


def test_the_api_lists_and_serves_names_that_are_not_utf8(built: tuple[Path, Path, Path]) -> None:
    gallery, index, _ = built
    with app_clients({"index_path": index, "model_path": index / "model.onnx", "threads": 1}) as make:
        client = make()
        query = (gallery / "cats" / LATIN1_FILE).read_bytes()
        found = client.post("/v1/search", files={"image": ("q.png", query, "image/png")}, params={"k": 4})
        assert found.status_code == 200, found.text
        by_path = {result["path"]: result for result in found.json()["results"]}
        assert {"cats/caf\\xe9.png", "cats/naïve\\xff.png", "pr\\xeats/1.png"} <= set(by_path)
        assert by_path["pr\\xeats/1.png"]["label"] == "pr\\xeats"
        for result in by_path.values():
            thumbnail = client.get(f"/v1/items/{result['id']}/thumbnail")
            assert thumbnail.status_code == 200, thumbnail.text
            assert thumbnail.headers["content-type"] == "image/jpeg"
        shown = "cats/caf\\xe9.png"
        item = client.get(f"/v1/items/{by_path[shown]['id']}")
        assert item.json()["path"] == "cats/caf\\xe9.png"


@pytest.mark.server
def test_a_running_watcher_indexes_a_name_that_is_not_utf8(tmp_path: Path, small_model: Path) -> None:
    gallery, index, log = tmp_path / "gallery", tmp_path / "index", tmp_path / "watch.log"
    (gallery / "cats").mkdir(parents=True)
    make_image(0, size=(64, 56)).save(gallery / "cats" / "0.png")
    command = [sys.executable, "-m", "cli.main", "watch", str(gallery), "--index", str(index)]
    command += ["--model", str(small_model), "--settle", "0.3", "--threads", "1"]
    process = subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "watching" in log.read_text(), 90, "the watcher to start", details=log.read_text)
        make_image(1, size=(64, 56)).save(gallery / "cats" / LATIN1_FILE)
        os.mkfifo(gallery / "cats" / "stuck.png")  # skipped, never opened
        make_image(2, size=(64, 56)).save(gallery / "cats" / "after.png")
        wait_until(
            lambda: {f"cats/{LATIN1_FILE}", "cats/after.png"} <= set(_paths(index)),
            90,
            "the watcher to index both",
            details=log.read_text,
        )
        assert process.poll() is None, log.read_text()
        assert "cats/stuck.png" not in _paths(index)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_build_index_skips_a_fifo_in_the_gallery(tmp_path: Path, small_model: Path) -> None:
    gallery = _gallery(tmp_path / "gallery")
    os.mkfifo(gallery / "cats" / "pipe.png")
    (gallery / "cats" / "dev.jpg").symlink_to("/dev/zero")
    started = time.monotonic()
    _build(gallery, tmp_path / "index", small_model)
    assert time.monotonic() - started < 120
    assert not {"cats/pipe.png", "cats/dev.jpg"} & set(_paths(tmp_path / "index"))


def _special(path: Path, kind: str) -> None:
    """Put a special file of ``kind`` at ``path`` (whatever was there)."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to fifo":
        os.mkfifo(path.with_name(path.name + ".fifo"))
        path.symlink_to(path.name + ".fifo")
    elif kind == "dev zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()


# (file of the index, special file): what a reload reads before anything else.
RELOADS = [
    ("manifest.json", "fifo"),
    ("manifest.json", "link to fifo"),
    ("manifest.json", "dev zero"),
    ("model.json", "dev zero"),
    ("model.onnx", "fifo"),
    ("items.sqlite", "fifo"),
    ("vectors.faiss", "folder"),
]


def test_a_reload_of_special_files_is_refused_at_once(built: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, index, _ = built
    defaults = {"index_path": index, "model_path": index / "model.onnx", "threads": 1, "api_key": API_KEY}
    with app_clients(defaults) as make:
        client = make()
        for name, kind in RELOADS:
            hostile = tmp_path / f"hostile-{name}-{kind.replace(' ', '-')}"
            shutil.copytree(index, hostile)
            _special(hostile / name, kind)
            started = time.monotonic()
            refused = client.post(
                "/v1/admin/reload", json={"index_path": str(hostile)}, headers={"X-API-Key": API_KEY}
            )
            took = time.monotonic() - started
            assert 400 <= refused.status_code < 500, (name, kind, refused.text)
            assert took < AT_ONCE, (name, kind, took)
            message = refused.json()["error"]["message"]  # model.json: not a file, so "missing"
            assert "regular file" in message or "missing" in message, (name, kind, refused.text)
        again = client.post("/v1/admin/reload", json={}, headers={"X-API-Key": API_KEY})
        assert again.status_code == 200, again.text  # no lock left held


def test_a_gallery_file_swapped_for_a_fifo_is_refused_at_once(built: tuple[Path, Path, Path]) -> None:
    gallery, index, _ = built
    item = _paths(index)["cats/0.png"]
    _special(gallery / "cats" / "0.png", "fifo")
    with app_clients({"index_path": index, "model_path": index / "model.onnx", "threads": 1}) as make:
        client = make()
        started = time.monotonic()
        thumbnail = client.get(f"/v1/items/{item}/thumbnail")
        similar = client.get(f"/v1/items/{item}/similar")
        assert time.monotonic() - started < AT_ONCE
        for answer in (thumbnail, similar):  # not a file of the gallery: as if gone
            assert answer.status_code == 404, answer.text


@pytest.mark.parametrize("kind", ["fifo", "dev zero", "folder"])
def test_query_of_a_special_file_fails_at_once(built: tuple[Path, Path, Path], kind: str) -> None:
    gallery, index, _ = built
    query = gallery / "query.png"
    _special(query, kind)
    started = time.monotonic()
    result = runner.invoke(app, ["query", str(query), "--index", str(index)])
    assert time.monotonic() - started < AT_ONCE
    assert result.exit_code == 2, result.output
    assert "not a regular file" in result.output


@pytest.mark.parametrize("kind", ["fifo", "folder", "dev zero"])
def test_a_plan_that_is_a_special_file_fails_at_once(built: tuple[Path, Path, Path], kind: str) -> None:
    _, index, _ = built
    plan = index.parent / "plan.json"
    _special(plan, kind)
    started = time.monotonic()
    result = runner.invoke(app, ["duplicates", "--index", str(index), "--apply", str(plan)])
    assert time.monotonic() - started < AT_ONCE
    assert result.exit_code == 2, result.output
    assert "not a regular file" in result.output


def test_a_plan_member_that_is_not_a_file_is_refused_before_any_move(built: tuple[Path, Path, Path]) -> None:
    gallery, index, _ = built
    paths = _paths(index)
    (gallery / "cats" / "folder.png").mkdir()
    os.mkfifo(gallery / "cats" / "pipe.png")
    with app_clients({"index_path": index, "model_path": index / "model.onnx", "api_key": API_KEY}) as make:
        client = make()
        for odd in ("cats/folder.png", "cats/pipe.png"):
            members = [
                {"id": paths["cats/0.png"], "path": "cats/0.png", "action": "keep", "content_hash": "0" * 64},
                {
                    "id": paths[f"cats/{LATIN1_FILE}"],
                    "path": "cats/1.png",
                    "action": "set_aside",
                    "content_hash": "0" * 64,
                },
                {"id": 99, "path": odd, "action": "set_aside", "content_hash": "0" * 64},
            ]
            plan = {"version": 1, "plan_id": "p1", "groups": [{"members": members}]}
            started = time.monotonic()
            applied = client.post("/v1/duplicates/apply", json=plan, headers={"X-API-Key": API_KEY})
            assert time.monotonic() - started < AT_ONCE
            assert applied.status_code == 409, applied.text
            assert applied.json()["error"]["code"] == "not_a_file"
    assert (gallery / "cats" / "0.png").is_file()
    assert not (gallery / ".dmlsearch-trash").exists()  # nothing moved
