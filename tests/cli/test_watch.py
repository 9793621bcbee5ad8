"""``dmlsearch watch`` as a real process: a killed watcher catches up on restart; a server sees it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.lib.images import image_bytes, make_image
from engine.build.indexing import build_index
from engine.build.rebuild import rebuild_index
from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from index.gallery import GalleryIndex
from index.manifest import Manifest
from tests.support.servers import uvicorn_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.server  # every test runs `dmlsearch watch`, a long-running process

TIMEOUT = 90  # a process start (model load) plus a batch, on a busy 2-core machine


def _start_watch(gallery: Path, index: Path, model: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "cli.main", "watch", str(gallery), "--index", str(index)]
    command += ["--model", str(model), "--settle", "0.3", "--threads", "1"]
    return subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT)


def _items(index_dir: Path) -> dict[str, int]:
    index = GalleryIndex.open(index_dir)
    try:
        return {item.path: item.id for item in index.items.scan()}
    finally:
        index.close()


def test_killed_watcher_catches_up_by_content_hash_on_restart(tmp_path: Path, exported_model: Path) -> None:
    gallery, index, log = tmp_path / "gallery", tmp_path / "index", tmp_path / "watch.log"
    (gallery / "cats").mkdir(parents=True)
    for i in range(3):
        make_image(i, size=(64, 56)).save(gallery / "cats" / f"{i}.png")
    process = _start_watch(gallery, index, exported_model, log)
    try:
        wait_until(lambda: "watching" in log.read_text(), TIMEOUT, "the watcher to catch up")
        make_image(50, size=(64, 56)).save(gallery / "cats" / "live.png")
        wait_until(lambda: "cats/live.png" in _items(index), TIMEOUT, "the live addition")
    finally:
        process.send_signal(signal.SIGKILL)  # no clean shutdown
        process.wait(timeout=30)
    before = _items(index)

    # Changes while no watcher runs.
    (gallery / "cats" / "0.png").rename(gallery / "cats" / "zero.png")
    (gallery / "cats" / "1.png").unlink()
    make_image(60, size=(64, 56)).save(gallery / "cats" / "offline.png")

    process = _start_watch(gallery, index, exported_model, log)
    try:
        wait_until(
            lambda: log.read_text().count("watching") == 2, TIMEOUT, "the restarted watcher's catch-up"
        )
        after = _items(index)
        assert set(after) == {"cats/zero.png", "cats/2.png", "cats/live.png", "cats/offline.png"}
        assert after["cats/zero.png"] == before["cats/0.png"]  # renamed while down: same id
        assert "catch-up: 1 indexed, 1 moved, 1 removed, 2 unchanged" in log.read_text()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_running_server_sees_the_watchers_changes_without_a_restart(
    tmp_path: Path, exported_model: Path
) -> None:
    gallery, index, log = tmp_path / "gallery", tmp_path / "index", tmp_path / "watch.log"
    (gallery / "cats").mkdir(parents=True)
    for i in range(3):
        make_image(i, size=(64, 56)).save(gallery / "cats" / f"{i}.png")
    watcher = _start_watch(gallery, index, exported_model, log)
    try:
        wait_until(lambda: "watching" in log.read_text(), TIMEOUT, "the watcher to catch up")
        env = {"DMLSEARCH_INDEX_POLL_SECONDS": "0.2"}
        with uvicorn_server(["--index", str(index), "--model", str(exported_model)], env=env) as base:
            assert httpx.get(f"{base}/v1/stats").json()["count"] == 3
            new = image_bytes(make_image(70, size=(64, 56)))
            (gallery / "dogs").mkdir()
            (gallery / "dogs" / "new.png").write_bytes(new)
            count = lambda: httpx.get(f"{base}/v1/stats").json()["count"]  # noqa: E731
            wait_until(lambda: count() == 4, TIMEOUT, "the server to see the added image")
            best = httpx.post(f"{base}/v1/search?k=1", files={"image": ("q.png", new)}).json()["results"][0]
            assert (best["path"], best["label"]) == ("dogs/new.png", "dogs")
            assert best["score"] > 0.999

            (gallery / "cats" / "1.png").unlink()
            wait_until(lambda: count() == 3, TIMEOUT, "the server to see the deletion")
            paths = {item["path"] for item in httpx.get(f"{base}/v1/items").json()["items"]}
            assert paths == {"cats/0.png", "cats/2.png", "dogs/new.png"}
    finally:
        watcher.send_signal(signal.SIGINT)
        watcher.wait(timeout=30)
    assert watcher.returncode == 0
    assert "stopped" in log.read_text()


def _fingerprint(index_dir: Path) -> str:
    return Manifest.load(index_dir).model_fingerprint


def test_a_promotion_through_a_link_carries_the_watcher_and_the_server_along(
    tmp_path: Path, exported_model: Path, small_model: Path
) -> None:
    """The README's promotion with a watcher running: a photo added afterwards reached the old index (124
    items) while the server served the new one (123). Both now follow the link they were given."""
    gallery, log = tmp_path / "gallery", tmp_path / "watch.log"
    old, new, served = tmp_path / "index", tmp_path / "index-new", tmp_path / "served"
    (gallery / "cats").mkdir(parents=True)
    for i in range(3):
        make_image(i, size=(64, 56)).save(gallery / "cats" / f"{i}.png")
    build_index(gallery, Embedder(small_model, threads=1), old, progress=False)
    served.symlink_to("index", target_is_directory=True)
    watcher = _start_watch(gallery, served, small_model, log)
    try:
        wait_until(lambda: "watching" in log.read_text(), TIMEOUT, "the watcher to catch up")
        env = {"DMLSEARCH_INDEX_POLL_SECONDS": "0.2"}
        with uvicorn_server(["--index", str(served)], env=env) as base:
            stats = lambda: httpx.get(f"{base}/v1/stats").json()  # noqa: E731
            before = _items(old)
            rebuild_index(old, Embedder(exported_model, threads=1), new, progress=False)
            (tmp_path / "served.next").symlink_to("index-new", target_is_directory=True)
            (tmp_path / "served.next").replace(served)  # the promotion: one atomic rename
            following = lambda: "another index took" in log.read_text()  # noqa: E731
            wait_until(following, TIMEOUT, "the watcher to follow", details=log.read_text)
            new_model = _fingerprint(new)
            wait_until(lambda: stats()["model"]["fingerprint"] == new_model, TIMEOUT, "the server's reload")

            make_image(80, size=(64, 56)).save(gallery / "cats" / "after.png")
            wait_until(lambda: stats()["count"] == 4, TIMEOUT, "the server to see the photo added after")
            assert set(_items(new)) == {*before, "cats/after.png"}
            assert {path: _items(new)[path] for path in before} == before  # ids kept by the rebuild
            assert _items(old) == before  # the old index got nothing more
            assert _fingerprint(old) != new_model
            assert f"model {_fingerprint(old)[:12]} -> {new_model[:12]}" in log.read_text()
    finally:
        watcher.send_signal(signal.SIGINT)
        watcher.wait(timeout=30)
    assert watcher.returncode == 0


def test_build_index_with_a_new_model_in_place_carries_the_watcher_along(
    tmp_path: Path, exported_model: Path, small_model: Path
) -> None:
    gallery, index, log = tmp_path / "gallery", tmp_path / "index", tmp_path / "watch.log"
    (gallery / "cats").mkdir(parents=True)
    for i in range(3):
        make_image(i, size=(64, 56)).save(gallery / "cats" / f"{i}.png")
    watcher = _start_watch(gallery, index, small_model, log)
    try:
        wait_until(lambda: "watching" in log.read_text(), TIMEOUT, "the watcher to catch up")
        before = _items(index)
        command = [sys.executable, "-m", "cli.main", "build-index", str(gallery), "--out", str(index)]
        build = subprocess.run(
            [*command, "--model", str(exported_model), "--threads", "1", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert build.returncode == 0, build.stderr
        assert "its 3 items were re-embedded under their ids" in build.stdout
        following = lambda: "another index took" in log.read_text()  # noqa: E731
        wait_until(following, TIMEOUT, "the watcher to follow", details=log.read_text)

        make_image(80, size=(64, 56)).save(gallery / "cats" / "after.png")
        # Saved into the swapped-in index (its manifest counts it), not over it.
        wait_until(lambda: Manifest.load(index).count == 4, TIMEOUT, "the photo added after to be saved")
        after = _items(index)
        assert set(after) == {*before, "cats/after.png"}
        assert {path: after[path] for path in before} == before
        assert _fingerprint(index) == ModelCard.load(exported_model).fingerprint
    finally:
        watcher.send_signal(signal.SIGINT)
        watcher.wait(timeout=30)
    assert watcher.returncode == 0
