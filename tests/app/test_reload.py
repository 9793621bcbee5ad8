"""Serving an index that carries its model, and switching a running server to another index without
dropping a request: POST /v1/admin/reload and SIGHUP, in process and under load in a real uvicorn."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.context import AppContext
from bench.lib.images import image_bytes, make_image
from engine.build.indexing import build_index
from engine.build.rebuild import rebuild_index
from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from index.manifest import Manifest
from tests.support.apps import app_clients
from tests.support.served import Served
from tests.support.servers import API_KEY, uvicorn_process

PNG = image_bytes(make_image(3))


@pytest.fixture(scope="module")
def new_index(served_module: Served, small_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served index re-embedded by another model (a new bundle): what servers switch to."""
    out = tmp_path_factory.mktemp("new") / "index"
    rebuild_index(served_module.index, Embedder(small_model, threads=1), out, progress=False)
    return out


@pytest.fixture
def client_for(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    with app_clients({"threads": 1, "rate_limit_per_second": 0, "index_poll_seconds": 0}) as make:
        yield make


def _fingerprint(index: Path) -> str:
    return Manifest.load(index).model_fingerprint


def _search(client: TestClient) -> str:
    response = client.post("/v1/search?k=3", files={"image": ("q.png", PNG, "image/png")})
    assert response.status_code == 200, response.text
    assert len(response.json()["results"]) == 3
    return response.json()["model_fingerprint"]


def test_a_copied_bundle_is_served_without_a_model_path(
    served_module: Served, client_for: Callable[..., TestClient], tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(served_module.index, copy)
    client = client_for(index_path=copy)  # no model_path: the index carries its model
    assert client.get("/readyz").status_code == 200
    assert _search(client) == _fingerprint(served_module.index)
    assert client.get("/v1/stats").json()["model"]["fingerprint"] == _fingerprint(served_module.index)


def test_an_empty_model_path_variable_means_the_model_the_index_carries(
    new_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container restarted after a promotion: DMLSEARCH_MODEL_PATH= (set, empty) is "not set", not "."."""
    from app.api import create_app
    from app.settings import Settings

    monkeypatch.setenv("DMLSEARCH_MODEL_PATH", "")
    monkeypatch.setenv("DMLSEARCH_INDEX_PATH", str(new_index))
    settings = Settings(threads=1, rate_limit_per_second=0, index_poll_seconds=0)
    assert settings.model_path is None
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200
        assert _search(client) == _fingerprint(new_index)


def test_a_model_that_is_not_the_index_s_keeps_the_server_not_ready(
    served_module: Served, small_model: Path, client_for: Callable[..., TestClient]
) -> None:
    # Asked to wait: without that, a model that is not the index's is refused at start (test_readiness.py).
    client = client_for(index_path=served_module.index, model_path=small_model, wait_for_index=True)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert "is not the model" in response.json()["error"]["message"]


def test_reload_needs_the_api_key(served_module: Served, client_for: Callable[..., TestClient]) -> None:
    client = client_for(index_path=served_module.index, api_key=API_KEY)
    assert client.post("/v1/admin/reload").status_code == 401
    assert client.post("/v1/admin/reload", headers={"X-API-Key": "wrong"}).status_code == 401
    keyless = client_for(index_path=served_module.index)
    assert keyless.post("/v1/admin/reload", headers={"X-API-Key": API_KEY}).status_code == 403


def test_reload_switches_index_and_model_together(
    served_module: Served, new_index: Path, client_for: Callable[..., TestClient]
) -> None:
    client = client_for(index_path=served_module.index, api_key=API_KEY)
    old, new = _fingerprint(served_module.index), _fingerprint(new_index)
    assert _search(client) == old
    response = client.post(
        "/v1/admin/reload", headers={"X-API-Key": API_KEY}, json={"index_path": str(new_index)}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["model_fingerprint"], body["previous_model_fingerprint"]) == (new, old)
    assert body["count"] == Manifest.load(new_index).count
    stats = client.get("/v1/stats").json()
    assert stats["model_fingerprint"] == stats["model"]["fingerprint"] == new
    assert stats["dim"] == 24
    assert _search(client) == new
    # No body: the configured path again.
    response = client.post("/v1/admin/reload", headers={"X-API-Key": API_KEY})
    assert response.status_code == 200 and response.json()["model_fingerprint"] == old
    assert _search(client) == old


def test_a_reload_reads_the_new_model_s_card_once(
    served_module: Served,
    new_index: Path,
    client_for: Callable[..., TestClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Locating the model, comparing it with the served one and loading it share one read of model.json
    (before: three; the probe's child process reads its own)."""
    client = client_for(index_path=served_module.index, api_key=API_KEY)
    read, reads = ModelCard.load, list[Path]()
    monkeypatch.setattr(ModelCard, "load", lambda path: reads.append(path) or read(path))
    for body in (
        {"index_path": str(new_index)},
        {"index_path": str(new_index), "model_path": str(new_index / "model.onnx")},
    ):
        client.post("/v1/admin/reload", headers={"X-API-Key": API_KEY})  # the configured bundle again
        reads.clear()
        response = client.post("/v1/admin/reload", headers={"X-API-Key": API_KEY}, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["model_fingerprint"] == _fingerprint(new_index)
        assert reads == [new_index / "model.onnx"], body


def _broken_indexes(new_index: Path, exported_model: Path, root: Path) -> dict[str, tuple[dict, str]]:
    """Reload bodies that must fail, with what the answer must say (all 422, as the README says: a
    directory or model named that does not exist is a wrong body, not a wrong URL)."""
    truncated = root / "truncated"
    shutil.copytree(new_index, truncated)
    faiss_file = truncated / "vectors.faiss"
    faiss_file.write_bytes(faiss_file.read_bytes()[:100])
    modelless = root / "modelless"
    shutil.copytree(new_index, modelless)
    (modelless / "model.onnx").unlink()
    not_an_index = root / "empty"
    not_an_index.mkdir()
    return {
        "missing directory": ({"index_path": str(root / "nowhere")}, "not an index directory"),
        "not an index": ({"index_path": str(not_an_index)}, "not an index directory"),
        "truncated index": ({"index_path": str(truncated)}, "vectors.faiss"),
        "its model is missing": ({"index_path": str(modelless)}, "copy the whole index directory"),
        "another model": (
            {"index_path": str(new_index), "model_path": str(exported_model)},
            "is not the model",
        ),
    }


def test_a_failed_reload_keeps_the_served_index_and_says_why(
    served_module: Served,
    new_index: Path,
    exported_model: Path,
    client_for: Callable[..., TestClient],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = client_for(index_path=served_module.index, api_key=API_KEY)
    old = _fingerprint(served_module.index)
    for case, (body, reason) in _broken_indexes(new_index, exported_model, tmp_path).items():
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="dmlsearch.app"):
            response = client.post("/v1/admin/reload", headers={"X-API-Key": API_KEY}, json=body)
        assert response.status_code == 422, (case, response.text)
        error = response.json()["error"]
        assert error["code"] == "reload_failed", case
        assert error["message"].startswith("still serving the loaded index: "), case
        assert not re.search(r"\w+Error: ", error["message"]), (case, error["message"])
        assert reason in error["message"], (case, error["message"])
        assert any("reload of" in record.message and reason in record.message for record in caplog.records)
        assert client.get("/readyz").status_code == 200, case
        assert client.get("/v1/stats").json()["model"]["fingerprint"] == old, case
        assert _search(client) == old, case


def test_an_index_rebuilt_in_place_with_another_model_is_reloaded_with_it(
    served: Served, small_model: Path, client_for: Callable[..., TestClient]
) -> None:
    """build-index --model NEW into the served directory: the index poller switches model and index."""
    client = client_for(index_path=served.index, index_poll_seconds=0.2)
    old = _fingerprint(served.index)
    assert _search(client) == old
    build_index(served.gallery, Embedder(small_model, threads=1), served.index, progress=False)
    new = _fingerprint(served.index)
    assert new != old
    deadline = time.monotonic() + 60
    while client.get("/v1/stats").json()["model"]["fingerprint"] != new:
        assert time.monotonic() < deadline, "the server kept the old model"
        time.sleep(0.2)
    assert _search(client) == new


def test_a_query_embedded_by_a_model_swapped_out_meanwhile_is_answered_by_the_new_one(
    served_module: Served, new_index: Path, client_for: Callable[..., TestClient]
) -> None:
    """The reload does not wait for a query being embedded; the query then finds another model served and
    is embedded again by it (before: searched with the old model's vector, it mixed two models)."""
    client = client_for(index_path=served_module.index, api_key=API_KEY)
    old_service = AppContext.of(client.app).engine.service
    entered, release = threading.Event(), threading.Event()
    embed = old_service.embedder.embed_tensor

    def slow_embed(batch: object, **options: object) -> object:
        entered.set()
        assert release.wait(30)
        return embed(batch, **options)

    old_service.embedder.embed_tensor = slow_embed
    answers: list[httpx.Response] = []
    # The query in flight comes from the API key's holder and the new one from an address: two clients.
    # One client holds at most its share of the compute slots (app.compute), so a second query of the same
    # client would wait for the held one, which waits for it.
    query = threading.Thread(
        target=lambda: answers.append(
            client.post(
                "/v1/search?k=3", files={"image": ("q.png", PNG, "image/png")}, headers={"X-API-Key": API_KEY}
            )
        )
    )
    query.start()
    assert entered.wait(30)
    # The reload does not wait for the query in flight; a new query is answered by the new engine.
    reload = client.post(
        "/v1/admin/reload", headers={"X-API-Key": API_KEY}, json={"index_path": str(new_index)}
    )
    assert reload.status_code == 200
    assert _search(client) == _fingerprint(new_index)
    release.set()
    query.join(30)
    (answer,) = answers
    assert answer.status_code == 200
    assert answer.json()["model_fingerprint"] == _fingerprint(new_index)
    assert len(answer.json()["results"]) == 3


class _Load:
    """Client threads querying a server without pause, and one polling /readyz, recording every answer."""

    def __init__(self, base: str, clients: int = 3) -> None:
        self.base = base
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.fingerprints: list[str] = []
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._query) for _ in range(clients)]
        self.threads.append(threading.Thread(target=self._ready))

    def __enter__(self) -> _Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _record(self, response: httpx.Response, fingerprint: bool) -> None:
        with self.lock:
            self.statuses[response.status_code] += 1
            if fingerprint and response.status_code == 200:
                self.fingerprints.append(response.json()["model_fingerprint"])

    def _query(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                try:
                    response = http.post(
                        f"{self.base}/v1/search?k=5", files={"image": ("q.png", PNG, "image/png")}
                    )
                except httpx.HTTPError as err:
                    self.errors.append(repr(err))
                    continue
                self._record(response, fingerprint=True)

    def _ready(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                try:
                    self._record(http.get(f"{self.base}/readyz"), fingerprint=False)
                except httpx.HTTPError as err:
                    self.errors.append(repr(err))
                time.sleep(0.05)

    def answered(self, fingerprint: str) -> int:
        with self.lock:
            return sum(1 for f in self.fingerprints if f == fingerprint)

    def wait_for(self, fingerprint: str, count: int, timeout: float = 60) -> None:
        """Until ``count`` more answers came from the model ``fingerprint``."""
        target = self.answered(fingerprint) + count
        deadline = time.monotonic() + timeout
        while self.answered(fingerprint) < target:
            assert time.monotonic() < deadline, f"fewer than {count} answers from {fingerprint[:12]}"
            time.sleep(0.05)


def _stats_fingerprint(http: httpx.Client, base: str) -> str:
    return http.get(f"{base}/v1/stats").json()["model"]["fingerprint"]


@pytest.mark.server
def test_hot_swap_under_load_in_a_real_server(served_module: Served, new_index: Path, tmp_path: Path) -> None:
    """Reload by API and by SIGHUP (the served path is a symlink that gets repointed) while clients query
    without pause: every answer is a 200, /readyz never fails, answers move to the new model, and the
    server's log says what each reload did."""
    link = tmp_path / "served"
    link.symlink_to(served_module.index)
    old, new = _fingerprint(served_module.index), _fingerprint(new_index)
    env = {"DMLSEARCH_API_KEY": API_KEY, "DMLSEARCH_RATE_LIMIT_PER_SECOND": "0"}
    log = tmp_path / "server.log"
    with (
        uvicorn_process(["--index", str(link)], env, log=log) as (base, process),
        httpx.Client(timeout=60) as http,
        _Load(base) as load,
    ):
        load.wait_for(old, 10)
        # 1. SIGHUP after the operator repoints the configured path.
        swapped = tmp_path / "swap"
        swapped.symlink_to(new_index)
        os.replace(swapped, link)
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while _stats_fingerprint(http, base) != new:
            assert time.monotonic() < deadline, "SIGHUP did not reload the repointed index"
            time.sleep(0.1)
        load.wait_for(new, 10)
        # 2. A reload that fails keeps the new index.
        failed = http.post(
            f"{base}/v1/admin/reload",
            headers={"X-API-Key": API_KEY},
            json={"index_path": str(tmp_path / "nowhere")},
        )
        assert failed.status_code == 422 and "still serving" in failed.json()["error"]["message"]
        assert _stats_fingerprint(http, base) == new
        # 3. The API switches to a named directory (back to the old bundle).
        response = http.post(
            f"{base}/v1/admin/reload",
            headers={"X-API-Key": API_KEY},
            json={"index_path": str(served_module.index)},
        )
        assert response.status_code == 200, response.text
        assert _stats_fingerprint(http, base) == old
        load.wait_for(old, 10)
    assert load.errors == []
    assert set(load.statuses) == {200}, load.statuses
    assert load.answered(old) >= 20 and load.answered(new) >= 10
    logged = log.read_text()
    assert "SIGHUP: reloading the configured index" in logged
    assert f"reloaded {link}: model {new[:12]}, " in logged
    assert f"reload of {tmp_path / 'nowhere'} failed, still serving the loaded index" in logged
    assert f"reloaded {served_module.index}: model {old[:12]}, " in logged
