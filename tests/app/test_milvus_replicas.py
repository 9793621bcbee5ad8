"""Two ``dmlsearch serve`` replicas (real uvicorn processes) on one collection of the real Milvus server.

Replicas read at the ``Session`` consistency level (``index.milvus_backend.CONSISTENCY``): each sees its own
writes at once, and another replica's once the server has applied them, which the tests below measure
against :data:`REPLICA_DELAY_S`.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from bench.lib.images import image_bytes, make_image
from bench.lib.servers import serving
from cli.main import app
from foundation.defaults import GALLERY_MARK, TRASH_FOLDER
from index.connection import MilvusConnection
from index.gallery import GalleryIndex
from index.manifest import Manifest
from tests.support.milvus_server import MilvusServerProcess, milvus_target
from tests.support.servers import API_KEY, uvicorn_server
from tests.support.waiting import wait_until
from training.feedback_data import load_feedback

KEY = {"X-API-Key": API_KEY}
# How long a write through one replica may take to show on another: Milvus's Bounded staleness (5 s), an
# upper bound; measured here it is well under a second (see the test's output).
REPLICA_DELAY_S = 5.0


@pytest.fixture(scope="module")
def replicated(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    exported_model: Path,
    milvus_server: MilvusServerProcess,
) -> Iterator[list[str]]:
    """An index of a small gallery in a real Milvus server, and the serve arguments of a replica."""
    from engine.build.indexing import build_index
    from engine.model.embedder import Embedder

    root = tmp_path_factory.mktemp("replicas")
    gallery = root / "gallery"
    for i in range(9):
        (gallery / f"label{i % 3}").mkdir(parents=True, exist_ok=True)
        make_image(300 + i).save(gallery / f"label{i % 3}" / f"{i}.png")
    index = root / "index"
    build_index(
        gallery,
        Embedder(exported_model),
        index,
        progress=False,
        **milvus_target("milvus-server", request, index),
    )
    yield ["--index", str(index), "--model", str(exported_model), "--rate-limit", "0"]


def _search_top(base: str, image: bytes) -> int | None:
    response = httpx.post(f"{base}/v1/search", params={"k": 1}, files={"image": ("q.png", image)}, timeout=30)
    response.raise_for_status()
    results = response.json()["results"]
    return results[0]["id"] if results else None


def _time_until(condition: object, what: str) -> float:
    started = time.monotonic()
    wait_until(condition, REPLICA_DELAY_S, what, interval=0.02)
    return time.monotonic() - started


def test_a_write_through_one_replica_is_seen_by_the_other(replicated: list[str]) -> None:
    args = replicated
    env = {"DMLSEARCH_API_KEY": API_KEY}
    with uvicorn_server(args, env) as a, uvicorn_server(args, env) as b:
        image = image_bytes(make_image(4242), "PNG")
        added = httpx.post(
            f"{a}/v1/items",
            files={"images": ("n.png", image)},
            data={"label": "new"},
            headers=KEY,
            timeout=60,
        )
        assert added.status_code == 201, added.text
        new_id = added.json()["items"][0]["id"]
        assert _search_top(a, image) == new_id  # its own write, at once
        seen = _time_until(
            lambda: _search_top(b, image) == new_id, "replica B to find the item added through A"
        )
        assert httpx.get(f"{b}/v1/items/{new_id}").json()["label"] == "new"

        removed = httpx.delete(f"{b}/v1/items/{new_id}", headers=KEY, timeout=60)
        assert removed.status_code == 200, removed.text
        assert _search_top(b, image) != new_id
        gone = _time_until(
            lambda: (
                _search_top(a, image) != new_id and httpx.get(f"{a}/v1/items/{new_id}").status_code == 404
            ),
            "replica A to lose the item deleted through B",
        )
        print(
            f"added through A, found by B after {seen:.3f} s; "
            f"deleted through B, gone from A after {gone:.3f} s"
        )


def test_a_replica_killed_during_writes_loses_no_acknowledged_write(
    replicated: list[str],
) -> None:
    """``kill -9`` of replica A while it adds images one by one: every add it acknowledged (201) is in the
    collection, as replica B shows; the add in flight may or may not have landed, never half of it."""
    args = replicated
    env = {"DMLSEARCH_API_KEY": API_KEY}
    acknowledged: list[int] = []
    stop = threading.Event()

    with serving(args, env) as a, uvicorn_server(args, env) as b:

        def write() -> None:
            for n in range(1000):
                if stop.is_set():
                    return
                image = image_bytes(make_image(10_000 + n), "PNG")
                try:
                    response = httpx.post(
                        f"{a.url}/v1/items", files={"images": (f"{n}.png", image)}, headers=KEY, timeout=60
                    )
                except httpx.HTTPError:
                    return  # the replica is gone
                if response.status_code == 201:
                    acknowledged.append(response.json()["items"][0]["id"])

        writer = threading.Thread(target=write)
        writer.start()
        wait_until(lambda: len(acknowledged) >= 5, 120, "five acknowledged writes")
        a.process.kill()  # SIGKILL: no shutdown, no flush
        a.process.wait(timeout=10)
        stop.set()
        writer.join(timeout=70)
        assert not writer.is_alive()

        def all_on_b() -> bool:
            return all(httpx.get(f"{b}/v1/items/{item_id}").status_code == 200 for item_id in acknowledged)

        _time_until(all_on_b, f"replica B to show the {len(acknowledged)} acknowledged items")
        stats = httpx.get(f"{b}/v1/stats").json()
        assert stats["count"] >= 9 + len(acknowledged)


def _copy_index(index: Path, target: Path, gallery: Path | None = None) -> Path:
    """A replica's own copy of the index directory (its working folder), naming ``gallery`` if given."""
    shutil.copytree(index, target)
    if gallery is not None:
        manifest = Manifest.load(target)
        manifest.gallery_root = str(gallery.resolve())
        manifest.save(target)
    return target


def _add(base: str, seed: int) -> httpx.Response:
    image = image_bytes(make_image(seed), "PNG")
    return httpx.post(f"{base}/v1/items", files={"images": (f"{seed}.png", image)}, headers=KEY, timeout=60)


@pytest.mark.server  # the real Milvus server, through milvus_target
def test_replicas_write_to_the_one_shared_gallery_or_refuse_to_serve(
    tmp_path: Path, exported_model: Path, request: pytest.FixtureRequest
) -> None:
    """Issue 42, finding 3: uploads were written into each replica's own gallery folder, so a rebuild from
    either folder lost the other's. Two replicas with their own working folders (copies of the index
    directory) on one collection of the real server: with the one shared gallery, both write there and a
    rebuild keeps every upload and every delete; a replica whose gallery is another folder (a local copy
    of the photos) is refused: not ready, 503 on a write, and its build-index into the collection refused;
    and a replica whose share went away (the mount point empty) refuses writes."""
    shared = tmp_path / "shared-photos"
    for i in range(6):
        (shared / f"label{i % 2}").mkdir(parents=True, exist_ok=True)
        make_image(700 + i).save(shared / f"label{i % 2}" / f"{i}.png")
    target = milvus_target("milvus-server", request, tmp_path)
    milvus = target["milvus"]
    assert isinstance(milvus, MilvusConnection)
    built = tmp_path / "built"
    build = ["build-index", str(shared), "--model", str(exported_model), "--no-progress"]
    where = ["--backend", "milvus", "--milvus-uri", milvus.uri, "--milvus-collection", milvus.collection]
    result = CliRunner().invoke(app, [*build, "--out", str(built), *where])
    assert result.exit_code == 0, result.output
    a = _copy_index(built, tmp_path / "machine-a" / "index")
    b = _copy_index(built, tmp_path / "machine-b" / "index")
    env = {"DMLSEARCH_API_KEY": API_KEY}
    serve = ["--model", str(exported_model), "--rate-limit", "0"]

    with (
        uvicorn_server(["--index", str(a), *serve], env) as on_a,
        uvicorn_server(["--index", str(b), *serve], env) as on_b,
    ):
        uploads = []
        for base, seed in ((on_a, 9001), (on_b, 9002), (on_a, 9003)):
            added = _add(base, seed)
            assert added.status_code == 201, added.text
            uploads.append(added.json()["items"][0])
        deleted = httpx.delete(f"{on_b}/v1/items/{uploads[2]['id']}", headers=KEY, timeout=60)
        assert deleted.status_code == 200, deleted.text
        for upload in uploads[:2]:  # both in the one folder every replica writes to
            assert (shared / upload["path"]).is_file()

    # A rebuild from the shared folder, through either working folder: every upload stays, the delete too.
    for index in (a, b):
        result = CliRunner().invoke(app, [*build, "--out", str(index)])
        assert result.exit_code == 0, result.output
        assert "indexed 0 images" in result.output and "0 removed" in result.output
    opened = GalleryIndex.open(a)
    paths = {item.path for item in opened.items.scan()}
    opened.close()
    assert len(paths) == 6 + 2 and {upload["path"] for upload in uploads[:2]} <= paths

    # A replica whose gallery is a local copy of the photos (not the share): refused, as is its rebuild.
    local = tmp_path / "machine-c" / "photos"
    shutil.copytree(shared, local, ignore=shutil.ignore_patterns(GALLERY_MARK, TRASH_FOLDER))
    c = _copy_index(built, tmp_path / "machine-c" / "index", gallery=local)
    copied = sorted(local.rglob("*"))
    with uvicorn_server(["--index", str(c), *serve], env, ready_path="/healthz") as on_c:
        ready = httpx.get(f"{on_c}/readyz", timeout=10)
        assert ready.status_code == 503 and "not the one" in ready.json()["error"]["message"], ready.text
        assert _add(on_c, 9004).status_code == 503
    assert sorted(local.rglob("*")) == copied  # nothing written into the local copy
    result = CliRunner().invoke(app, [*build[:1], str(local), *build[2:], "--out", str(c)])
    assert result.exit_code == 2 and "not the one" in result.output, result.output
    # Read-only, it may serve the copy: it writes nothing.
    with uvicorn_server(["--index", str(c), *serve]) as read_only:
        assert httpx.get(f"{read_only}/v1/stats", timeout=10).json()["count"] == 8

    # The share gone from under a running replica (the mount point left empty): its writes are refused.
    with uvicorn_server(["--index", str(a), *serve], env) as on_a:
        shared.rename(tmp_path / "unmounted")
        shared.mkdir()
        refused = _add(on_a, 9005)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "gallery_not_shared"
        assert list(shared.iterdir()) == []


def _judge_everything(base: str, query: dict, count: int) -> int:
    """Judge ``count`` results of ``query`` through ``base`` (👍 its label, 👎 another); how many were."""
    similar = httpx.get(f"{base}/v1/items/{query['id']}/similar", params={"k": count}, timeout=60)
    similar.raise_for_status()
    for result in similar.json()["results"]:
        sign = 1 if result["label"] == query["label"] else -1
        body = {"query_item": query["id"], "result": result["id"], "sign": sign}
        judged = httpx.post(f"{base}/v1/feedback", json=body, headers=KEY, timeout=60)
        assert judged.status_code == 201, judged.text
    return len(similar.json()["results"])


def _judgment_total(base: str) -> int:
    return int(httpx.get(f"{base}/v1/feedback", params={"limit": 1}, timeout=30).json()["total"])


def test_judgments_made_through_either_replica_reach_both_and_one_training_run(
    replicated: list[str], tmp_path: Path
) -> None:
    """Judgments (POST /v1/feedback) are kept in the collection's ``<collection>_judgments`` on the Milvus
    server, not in a replica's working folder: two replicas with their own copies of the index directory
    list every judgment made through either, a judgment deleted through one is gone from the other, and
    the judgments `train --feedback` reads from either copy (training.feedback_data) are all of them."""
    index, serve = Path(replicated[1]), replicated[2:]  # --index INDEX, the rest
    copies = {name: _copy_index(index, tmp_path / f"machine-{name}" / "index") for name in "ab"}
    env = {"DMLSEARCH_API_KEY": API_KEY}
    with (
        uvicorn_server(["--index", str(copies["a"]), *serve], env) as a,
        uvicorn_server(["--index", str(copies["b"]), *serve], env) as b,
    ):
        before = _judgment_total(a)
        items = httpx.get(f"{a}/v1/items", params={"limit": 1000}, timeout=30).json()["items"]
        queries = [item for item in items if item["label"] in {"label0", "label1", "label2"}]
        assert len(queries) == 9, items
        # Every item judged for each query (each has both signs), the queries alternating between replicas.
        made = sum(_judge_everything((a, b)[n % 2], q, len(items) - 1) for n, q in enumerate(queries))
        total = before + made
        for base in (a, b):
            wait_until(lambda b=base: _judgment_total(b) == total, REPLICA_DELAY_S, f"{total} judgments")

        listed = httpx.get(f"{a}/v1/feedback", params={"limit": 1000}, timeout=30).json()["judgments"]
        removed = httpx.delete(f"{b}/v1/feedback/{listed[-1]['id']}", headers=KEY, timeout=30)
        assert removed.status_code == 200, removed.text
        wait_until(lambda: _judgment_total(a) == total - 1, REPLICA_DELAY_S, "the deletion through B on A")

    # What a training run reads, from either working folder's copy: every judgment but the deleted one.
    kept = {(j["query_item"], j["result"]) for j in listed[:-1] if j["query_item"] != j["result"]}
    for copy in copies.values():
        feedback = load_feedback(copy, seed=0, validation=True)
        pairs = {(pair.query, pair.result) for pair in (*feedback.train, *feedback.val, *feedback.test)}
        assert pairs == kept and feedback.test, (len(pairs), len(kept))
