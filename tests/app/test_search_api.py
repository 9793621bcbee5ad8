"""The search API in-process: uploads and base64, paging, scores, batch, search by item, items, stats."""

from __future__ import annotations

import base64
from collections.abc import Callable
from io import BytesIO

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tests.support.served import Served

CAT = "cat/00_crop.jpg"
COFFEE = "coffee/01_crop.jpg"


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


def upload(served: Served, relative: str) -> bytes:
    return (served.gallery / relative).read_bytes()


def test_multipart_and_base64_json_give_the_same_ranked_results(client: TestClient, served: Served) -> None:
    data = upload(served, CAT)
    multipart = client.post("/v1/search", params={"k": 5}, files={"image": ("q.jpg", data)})
    as_json = client.post("/v1/search", params={"k": 5}, json={"image": base64.b64encode(data).decode()})
    data_url = client.post(
        "/v1/search",
        params={"k": 5},
        json={"image": "data:image/jpeg;base64," + base64.b64encode(data).decode()},
    )
    assert multipart.status_code == as_json.status_code == data_url.status_code == 200, multipart.text
    body = multipart.json()
    assert [r["rank"] for r in body["results"]] == [1, 2, 3, 4, 5]
    assert body["results"][0]["path"] == CAT
    assert body["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert [r["score"] for r in body["results"]] == sorted(
        (r["score"] for r in body["results"]), reverse=True
    )
    assert all(result["label"] == "cat" for result in body["results"])
    assert body["took_ms"] > 0
    assert set(body["timings_ms"]) == {"upload", "queue", "decode", "preprocess", "embed", "search"}
    stats = client.get("/v1/stats").json()
    assert body["model_fingerprint"] == stats["model_fingerprint"] == stats["model"]["fingerprint"]
    assert [r["id"] for r in as_json.json()["results"]] == [r["id"] for r in body["results"]]
    assert [r["id"] for r in data_url.json()["results"]] == [r["id"] for r in body["results"]]


def test_offset_pages_through_one_ranking_and_min_score_cuts_it(client: TestClient, served: Served) -> None:
    files = {"image": ("q.jpg", upload(served, COFFEE))}
    full = client.post("/v1/search", params={"k": 12}, files=files).json()["results"]
    page = client.post("/v1/search", params={"k": 4, "offset": 4}, files=files).json()["results"]
    assert [r["id"] for r in page] == [r["id"] for r in full[4:8]]
    assert [r["rank"] for r in page] == [5, 6, 7, 8]
    threshold = (full[2]["score"] + full[3]["score"]) / 2
    cut = client.post("/v1/search", params={"k": 12, "min_score": threshold}, files=files).json()["results"]
    assert [r["id"] for r in cut] == [r["id"] for r in full[:3]]


def test_k_larger_than_the_gallery_returns_everything_once(client: TestClient, served: Served) -> None:
    response = client.post("/v1/search", params={"k": 1000}, files={"image": ("q.jpg", upload(served, CAT))})
    assert response.status_code == 200
    ids = [r["id"] for r in response.json()["results"]]
    assert len(ids) == len(set(ids)) == client.get("/v1/stats").json()["count"]


def test_predict_votes_for_the_neighbours_label(client: TestClient, served: Served) -> None:
    response = client.post(
        "/v1/search", params={"k": 5, "predict": True}, files={"image": ("q.jpg", upload(served, CAT))}
    )
    prediction = response.json()["prediction"]
    assert prediction["label"] == "cat"
    assert 0.5 < prediction["confidence"] <= 1.0
    assert sum(prediction["votes"].values()) == pytest.approx(1.0)
    plain = client.post("/v1/search", params={"k": 5}, files={"image": ("q.jpg", upload(served, CAT))})
    assert plain.json()["prediction"] is None


def test_rerank_pddm_without_a_pddm_unit_is_a_clear_422(client: TestClient, served: Served) -> None:
    response = client.post(
        "/v1/search", params={"rerank": "pddm"}, files={"image": ("q.jpg", upload(served, CAT))}
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "rerank_unavailable"
    assert "PDDM" in response.json()["error"]["message"]
    assert client.get("/v1/stats").json()["rerankers"] == []
    unknown = client.post("/v1/search", params={"rerank": "magic"}, files={"image": ("q.jpg", b"x")})
    assert unknown.status_code == 422


def test_batch_embeds_many_images_and_matches_single_searches(client: TestClient, served: Served) -> None:
    images = [upload(served, CAT), upload(served, COFFEE), upload(served, "rocket/03_mirror.jpg")]
    batch = client.post(
        "/v1/search/batch",
        params={"k": 4},
        files=[("images", (f"{i}.jpg", data)) for i, data in enumerate(images)],
    )
    assert batch.status_code == 200, batch.text
    queries = batch.json()["queries"]
    assert len(queries) == 3
    for data, query in zip(images, queries, strict=True):
        single = client.post("/v1/search", params={"k": 4}, files={"image": ("q.jpg", data)}).json()[
            "results"
        ]
        assert [r["id"] for r in query["results"]] == [r["id"] for r in single]
        assert [r["score"] for r in query["results"]] == pytest.approx([r["score"] for r in single], abs=1e-5)
    as_json = client.post(
        "/v1/search/batch", params={"k": 4}, json={"images": [base64.b64encode(d).decode() for d in images]}
    )
    assert [[r["id"] for r in q["results"]] for q in as_json.json()["queries"]] == [
        [r["id"] for r in q["results"]] for q in queries
    ]


def test_similar_searches_by_an_indexed_item_and_leaves_it_out(client: TestClient, served: Served) -> None:
    item_id = client.post(
        "/v1/search", params={"k": 1}, files={"image": ("q.jpg", upload(served, CAT))}
    ).json()["results"][0]["id"]
    similar = client.get(f"/v1/items/{item_id}/similar", params={"k": 5})
    assert similar.status_code == 200
    results = similar.json()["results"]
    assert len(results) == 5
    assert item_id not in [r["id"] for r in results]
    assert results[0]["label"] == "cat"
    assert [r["rank"] for r in results] == [1, 2, 3, 4, 5]


def test_item_metadata_image_and_thumbnail(client: TestClient, served: Served) -> None:
    item = client.post("/v1/search", params={"k": 1}, files={"image": ("q.jpg", upload(served, CAT))}).json()[
        "results"
    ][0]
    meta = client.get(f"/v1/items/{item['id']}")
    assert meta.status_code == 200
    assert meta.json()["path"] == CAT and meta.json()["label"] == "cat"
    original = client.get(f"/v1/items/{item['id']}/image")
    assert original.content == upload(served, CAT)
    thumb = client.get(f"/v1/items/{item['id']}/thumbnail", params={"size": 64})
    assert thumb.headers["content-type"] == "image/jpeg"
    assert max(Image.open(BytesIO(thumb.content)).size) == 64
    cached = client.get(
        f"/v1/items/{item['id']}/thumbnail",
        params={"size": 64},
        headers={"If-None-Match": thumb.headers["etag"]},
    )
    assert cached.status_code == 304
    page = client.get("/v1/items", params={"offset": 2, "limit": 3}).json()
    assert page["total"] == client.get("/v1/stats").json()["count"]
    assert len(page["items"]) == 3


def test_stats_health_readiness_and_openapi(client: TestClient) -> None:
    stats = client.get("/v1/stats").json()
    assert stats["count"] == 78 and stats["dim"] == 1280
    assert stats["backend"] == "faiss" and stats["metric"] == "cosine"
    assert stats["writes_enabled"] is False
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["count"] == 78
    spec = client.get("/openapi.json").json()
    search_body = spec["paths"]["/v1/search"]["post"]["requestBody"]["content"]
    assert set(search_body) == {"multipart/form-data", "application/json"}
    for path in (
        "/v1/search/batch",
        "/v1/items/{item_id}/similar",
        "/v1/items/{item_id}/thumbnail",
        "/v1/items",
    ):
        assert path in spec["paths"]
    assert "delete" in spec["paths"]["/v1/items/{item_id}"]


def test_metrics_report_request_and_stage_latency(client: TestClient, served: Served) -> None:
    client.post("/v1/search", files={"image": ("q.jpg", upload(served, CAT))})
    client.post("/v1/search", files={"image": ("q.jpg", b"not an image")})
    text = client.get("/metrics").text
    for stage in ("upload", "queue", "decode", "preprocess", "embed", "search"):
        assert f'dmlsearch_stage_duration_seconds_count{{stage="{stage}"}} 1.0' in text
    assert 'route="/v1/search",status="200"' in text
    assert 'route="/v1/search",status="400"' in text
    assert "dmlsearch_index_items 78.0" in text


def test_cors_origins_from_the_environment(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMLSEARCH_CORS_ORIGINS", "http://ui.example, http://other.example")
    client = make_client()
    allowed = client.get("/healthz", headers={"Origin": "http://ui.example"})
    assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
    refused = client.get("/healthz", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in refused.headers
    preflight = client.options(
        "/v1/items",
        headers={
            "Origin": "http://other.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "X-API-Key",
        },
    )
    assert preflight.status_code == 200
