"""The API over a Milvus index (Milvus Lite): search, search by item, add, remove and near-duplicates go
through Milvus."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api import create_app
from app.settings import Settings
from index.duplicates import EMBEDDING_ONLY_THRESHOLD
from tests.helpers import API_KEY, image_bytes, make_image

pytest.importorskip("milvus_lite", reason="Milvus Lite is not installed (pip install 'dmlsearch[milvus]')")


def test_api_over_a_milvus_lite_index(exported_model: Path, demo_gallery: Path, tmp_path: Path) -> None:
    from engine.embedder import Embedder
    from engine.indexing import build_index

    gallery = tmp_path / "gallery"
    shutil.copytree(demo_gallery, gallery)
    index = tmp_path / "index"
    build_index(gallery, Embedder(exported_model), index, progress=False, backend="milvus")
    settings = Settings(
        model_path=exported_model,
        index_path=index,
        backend="milvus",
        api_key=API_KEY,
        rate_limit_per_second=0,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        stats = client.get("/v1/stats").json()
        assert stats["backend"] == "milvus" and stats["count"] == 78
        query = (gallery / "cat/00_crop.jpg").read_bytes()
        top = client.post("/v1/search", params={"k": 3}, files={"image": ("q.jpg", query)}).json()["results"]
        assert top[0]["path"] == "cat/00_crop.jpg" and top[0]["score"] == pytest.approx(1.0, abs=1e-3)
        similar = client.get(f"/v1/items/{top[0]['id']}/similar", params={"k": 3}).json()["results"]
        assert all(r["label"] == "cat" for r in similar) and top[0]["id"] not in [r["id"] for r in similar]

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
        assert labels["new"] == 1 and sum(labels.values()) == 79
        hit = client.post("/v1/search", params={"k": 1}, files={"image": ("q.png", new)}).json()["results"][0]
        assert hit["id"] == new_id
        removed = client.delete(f"/v1/items/{new_id}", headers={"X-API-Key": API_KEY})
        assert removed.status_code == 200 and removed.json()["count"] == 78
        after = client.post("/v1/search", params={"k": 1}, files={"image": ("q.png", new)}).json()["results"]
        assert after[0]["id"] != new_id

        # Near-duplicates through the index protocol: Milvus keeps no signatures, so by cosine alone.
        duplicates = client.get("/v1/duplicates", params={"limit": 100}).json()
        assert duplicates["unsigned"] == 78 and "no perceptual signature" in duplicates["note"]
        assert duplicates["threshold"] == EMBEDDING_ONLY_THRESHOLD and duplicates["total"] >= 5
        labels = [{item["label"] for item in group["items"]} for group in duplicates["groups"]]
        assert all(len(group) == 1 for group in labels)  # copies of one photo, in its label's folder
