"""The real Milvus server stops while ``dmlsearch serve`` (a real uvicorn process) serves its collection:
``/readyz`` and searches answer 503 with the reason, quickly, and the API recovers when the server is back;
an API started while Milvus is down loads the index once it is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.lib.images import make_image
from bench.lib.servers import serving
from index.connection import MilvusConnection
from index.milvus_backend import REQUEST_TIMEOUT_S
from tests.support.milvus_server import MilvusServerProcess, running_milvus_server
from tests.tiers import starts

# How long the API may take to answer again once Milvus is back (it reloads its collections first).
RECOVERY_S = 120


@pytest.fixture
@starts("server")
def own_milvus_server() -> Iterator[MilvusServerProcess]:
    """A Milvus server of this test's own, to stop and start again (the session's server stays up)."""
    with running_milvus_server("dmlsearch-milvus-outage-") as server:
        yield server


def _search(base: str, image: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/search", params={"k": 1}, files={"image": ("q.png", image)}, timeout=60)


def test_the_api_answers_503_while_milvus_is_down_and_recovers_after(
    own_milvus_server: MilvusServerProcess, exported_model: Path, tmp_path: Path
) -> None:
    from engine.build.indexing import build_index
    from engine.model.embedder import Embedder

    gallery = tmp_path / "gallery"
    (gallery / "a").mkdir(parents=True)
    for i in range(6):
        make_image(700 + i).save(gallery / "a" / f"{i}.png")
    index = tmp_path / "index"
    build_index(
        gallery,
        Embedder(exported_model),
        index,
        progress=False,
        backend="milvus",
        milvus=MilvusConnection(own_milvus_server.uri),
    )
    query = (gallery / "a" / "0.png").read_bytes()
    with serving(["--index", str(index), "--model", str(exported_model)]) as api:
        assert _search(api.url, query).json()["results"][0]["path"] == "a/0.png"

        own_milvus_server.stop()
        started = time.monotonic()
        ready = httpx.get(f"{api.url}/readyz", timeout=60)
        assert ready.status_code == 503, ready.text
        error = ready.json()["error"]
        assert (
            error["code"] == "index_unavailable" and f"Milvus at {own_milvus_server.uri}" in error["message"]
        )
        searched = _search(api.url, query)
        assert searched.status_code == 503 and searched.json()["error"]["code"] == "index_unavailable"
        assert searched.headers["Retry-After"]
        assert time.monotonic() - started < 2 * REQUEST_TIMEOUT_S  # bounded: no hang
        assert httpx.get(f"{api.url}/healthz").status_code == 200  # the process itself is fine

        own_milvus_server.start()
        back = time.monotonic()
        while not (
            httpx.get(f"{api.url}/readyz", timeout=60).status_code == 200
            and _search(api.url, query).status_code == 200
        ):
            assert time.monotonic() - back < RECOVERY_S, "the API did not recover after Milvus came back"
            time.sleep(0.5)
        print(f"API answered again {time.monotonic() - back:.1f} s after Milvus was back")
        assert _search(api.url, query).json()["results"][0]["path"] == "a/0.png"
        assert api.process.poll() is None  # never restarted

    # A server started while Milvus is down is not ready, says why, and loads the index once Milvus is back.
    own_milvus_server.stop()
    with serving(["--index", str(index), "--model", str(exported_model)], ready_path="/healthz") as api:
        ready = httpx.get(f"{api.url}/readyz", timeout=60)
        assert ready.status_code == 503 and f"Milvus at {own_milvus_server.uri}" in ready.text
        own_milvus_server.start()
        back = time.monotonic()
        while _search(api.url, query).status_code != 200:
            assert time.monotonic() - back < RECOVERY_S, "the API did not load the index once Milvus was back"
            time.sleep(0.5)
        assert _search(api.url, query).json()["results"][0]["path"] == "a/0.png"
