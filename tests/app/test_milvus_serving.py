"""The API over each backend (FAISS, Milvus Lite, the real Milvus server): search, search by item, add,
remove, near-duplicates, the model-fingerprint refusal and /v1/admin/reload go through the index protocol."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api import create_app
from app.settings import Settings
from bench.lib.images import image_bytes, make_image, write_labelled_folder
from engine.duplicates.groups import EMBEDDING_ONLY_THRESHOLD
from tests.support.milvus_server import MILVUS_BACKENDS, MILVUS_PARAMS, milvus_target
from tests.support.servers import API_KEY

ENGINES = ["faiss", *MILVUS_PARAMS]
GALLERY_SIZE = 78  # the demo gallery's images


def _build(request: pytest.FixtureRequest, gallery: Path, model: Path, index: Path) -> None:
    """``gallery`` built into ``index`` with ``model`` on the engine ``request.param``."""
    from engine.build.indexing import build_index
    from engine.model.embedder import Embedder

    target = {"backend": "faiss"}
    if request.param in MILVUS_BACKENDS:
        target = milvus_target(request.param, request, index)
    build_index(gallery, Embedder(model), index, progress=False, **target)


@pytest.fixture(params=ENGINES)
def built(
    request: pytest.FixtureRequest, exported_model: Path, demo_gallery: Path, tmp_path: Path
) -> tuple[str, Path, Path]:
    """(engine, gallery, index) of the demo gallery built on ``engine``."""
    gallery = tmp_path / "gallery"
    shutil.copytree(demo_gallery, gallery)
    _build(request, gallery, exported_model, tmp_path / "index")
    return request.param, gallery, tmp_path / "index"


@pytest.fixture(params=ENGINES)
def of_the_exported_model(request: pytest.FixtureRequest, exported_model: Path, tmp_path: Path) -> Path:
    """An index on each engine whose vectors came from ``exported_model``: two generated photos (what the
    index holds does not matter to a refusal of its model, only whose vectors they are)."""
    gallery = write_labelled_folder(tmp_path / "gallery", classes=1, per_class=2)
    _build(request, gallery, exported_model, tmp_path / "index")
    return tmp_path / "index"


def _settings(model: Path, index: Path, **overrides: object) -> Settings:
    return Settings(model_path=model, index_path=index, api_key=API_KEY, rate_limit_per_second=0, **overrides)


def test_api_over_each_backend(exported_model: Path, built: tuple[str, Path, Path]) -> None:
    engine, gallery, index = built
    backend = "faiss" if engine == "faiss" else "milvus"
    with TestClient(create_app(_settings(exported_model, index, backend=backend))) as client:
        stats = client.get("/v1/stats").json()
        assert stats["backend"] == backend and stats["count"] == GALLERY_SIZE
        query = (gallery / "cat/00_crop.jpg").read_bytes()
        top = client.post("/v1/search", params={"k": 3}, files={"image": ("q.jpg", query)}).json()["results"]
        assert top[0]["path"] == "cat/00_crop.jpg" and top[0]["score"] == pytest.approx(1.0, abs=1e-3)
        similar = client.get(f"/v1/items/{top[0]['id']}/similar", params={"k": 3}).json()["results"]
        assert all(r["label"] == "cat" for r in similar) and top[0]["id"] not in [r["id"] for r in similar]
        by_label = client.post(
            "/v1/search", params={"k": 5, "label": "coffee"}, files={"image": ("q.jpg", query)}
        ).json()["results"]
        assert by_label and {r["label"] for r in by_label} == {"coffee"}

        new = image_bytes(make_image(77), "PNG")
        added = client.post(
            "/v1/items",
            files={"images": ("n.png", new)},
            data={"label": "new"},
            headers={"X-API-Key": API_KEY},
        )
        assert added.status_code == 201, added.text
        new_id = added.json()["items"][0]["id"]
        labels = {entry["label"]: entry["count"] for entry in client.get("/v1/labels").json()["labels"]}
        assert labels["new"] == 1 and sum(labels.values()) == GALLERY_SIZE + 1
        unlabelled = client.post(
            "/v1/items", files={"images": ("u.png", image_bytes(make_image(78), "PNG"))},
            headers={"X-API-Key": API_KEY},
        )  # fmt: skip
        assert unlabelled.status_code == 201 and unlabelled.json()["items"][0]["label"] is None
        unlabelled_id = unlabelled.json()["items"][0]["id"]
        assert client.get(f"/v1/items/{unlabelled_id}").json()["label"] is None  # "no label", not ""
        hit = client.post("/v1/search", params={"k": 1}, files={"image": ("q.png", new)}).json()["results"][0]
        assert hit["id"] == new_id
        for item_id in (new_id, unlabelled_id):
            assert client.delete(f"/v1/items/{item_id}", headers={"X-API-Key": API_KEY}).status_code == 200
        assert client.get("/v1/stats").json()["count"] == GALLERY_SIZE
        after = client.post("/v1/search", params={"k": 1}, files={"image": ("q.png", new)}).json()["results"]
        assert after[0]["id"] != new_id

        page = client.get("/v1/items", params={"offset": 0, "limit": 10}).json()
        ids = [item["id"] for item in page["items"]]
        assert page["total"] == GALLERY_SIZE and len(ids) == 10 and ids == sorted(ids)
        later = client.get("/v1/items", params={"offset": 10, "limit": 10}).json()["items"]
        assert min(item["id"] for item in later) > max(ids)

        duplicates = client.get("/v1/duplicates", params={"limit": 100}).json()
        if engine == "faiss":
            assert duplicates["unsigned"] == 0 and duplicates["total"] >= 5
        else:  # Milvus keeps no signatures: pairs by cosine alone, from its own kNN search
            assert duplicates["unsigned"] == GALLERY_SIZE and "no perceptual signature" in duplicates["note"]
            assert duplicates["threshold"] == EMBEDDING_ONLY_THRESHOLD and duplicates["total"] >= 5
        groups = [{item["label"] for item in group["items"]} for group in duplicates["groups"]]
        assert all(len(group) == 1 for group in groups)  # copies of one photo, in its label's folder

        reloaded = client.post("/v1/admin/reload", headers={"X-API-Key": API_KEY})
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["count"] == GALLERY_SIZE
        again = client.post("/v1/search", params={"k": 1}, files={"image": ("q.jpg", query)}).json()
        assert again["results"][0]["path"] == "cat/00_crop.jpg"


def test_an_index_of_another_model_is_refused(small_model: Path, of_the_exported_model: Path) -> None:
    """Served with another model than the one its vectors came from: the server refuses to start, saying
    why; told to wait for an index, it starts not ready, saying why, and a reload is refused."""
    from app.state import NothingToServeError

    index = of_the_exported_model
    with pytest.raises(NothingToServeError, match="rebuild the index with this model"):
        create_app(_settings(small_model, index))
    with TestClient(create_app(_settings(small_model, index, wait_for_index=True))) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 503 and "rebuild the index with this model" in ready.text
        assert client.post("/v1/admin/reload", headers={"X-API-Key": API_KEY}).status_code == 422
