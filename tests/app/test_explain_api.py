"""``/v1/explain``: both heatmaps of a result, for an uploaded query (POST) or between two items (GET)."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engine.build.indexing import build_index
from engine.model.embedder import Embedder
from tests.support.served import Served


def _check(body: dict, cosine: float | None = None) -> None:
    for side in ("query", "item"):
        heatmap = body[side]
        grid = np.asarray(heatmap["grid"])
        assert grid.shape == (7, 7)
        assert grid.sum() + heatmap["rest"] == pytest.approx(heatmap["total"], abs=1e-6)
        assert heatmap["total"] == pytest.approx(body["cosine"], abs=2e-5)  # the shares add up to the cosine
        x0, y0, x1, y1 = heatmap["peak"]["box"]  # pixels of the 224-px view: 3 x 3 positions of 32 px
        assert (x1 - x0, y1 - y0) == (96, 96) and min(x0, y0) >= 0 and max(x1, y1) <= 224
        overlay = Image.open(io.BytesIO(base64.b64decode(heatmap["overlay_jpeg"])))
        assert (overlay.format, overlay.size) == ("JPEG", (224, 224))
    assert body["query"]["peak"]["share"] == body["item"]["peak"]["share"]  # the share between the two
    if cosine is not None:
        assert body["cosine"] == pytest.approx(cosine, abs=1e-3)
    fraction = body["query"]["peak"]["share"] / body["cosine"]
    share = f"{fraction:.{1 if abs(fraction) < 0.1 else 0}%}"
    assert body["summary"].startswith(f"Similarity {body['cosine']:.3f} (the cosine of the two embeddings")
    assert f"The outlined regions, one in each image, carry {share} of the match." in body["summary"]


def test_an_uploaded_query_and_a_result(make_client: Callable[..., TestClient], served: Served) -> None:
    client = make_client()
    first, second = client.get("/v1/items", params={"limit": 2}).json()["items"]
    query = (served.gallery / first["path"]).read_bytes()
    results = client.post("/v1/search", files={"image": query}, params={"k": 50}).json()["results"]
    served_score = next(result["score"] for result in results if result["id"] == second["id"])
    answer = client.post("/v1/explain", params={"item": second["id"]}, files={"image": query})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["item_id"], body["query_item_id"]) == (second["id"], None)
    _check(body, served_score)
    as_json = client.post(
        "/v1/explain", params={"item": second["id"]}, json={"image": base64.b64encode(query).decode()}
    )
    assert as_json.status_code == 200 and as_json.json()["cosine"] == pytest.approx(body["cosine"], abs=1e-6)


def test_two_items(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    first, second = client.get("/v1/items", params={"limit": 2}).json()["items"]
    results = client.get(f"/v1/items/{first['id']}/similar", params={"k": 50}).json()["results"]
    served_score = next(result["score"] for result in results if result["id"] == second["id"])
    answer = client.get("/v1/explain", params={"item": second["id"], "query_item": first["id"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["query_item_id"] == first["id"]
    _check(answer.json(), served_score)


def test_a_box_explains_the_region_searched_by(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    client = make_client()
    first, second = client.get("/v1/items", params={"limit": 2}).json()["items"]
    query = (served.gallery / first["path"]).read_bytes()
    box = {"box": "0.1,0.2,0.7,0.9"}
    boxed = client.post("/v1/search", files={"image": query}, params={"k": 50, **box}).json()["results"]
    boxed_score = next(result["score"] for result in boxed if result["id"] == second["id"])
    whole = client.post("/v1/explain", params={"item": second["id"]}, files={"image": query}).json()
    answer = client.post("/v1/explain", params={"item": second["id"], **box}, files={"image": query})
    assert answer.status_code == 200, answer.text
    _check(answer.json(), boxed_score)  # the box's cosine, as the boxed search scored it
    assert answer.json()["cosine"] != pytest.approx(whole["cosine"], abs=1e-4)
    by_item = client.get("/v1/explain", params={"item": second["id"], "query_item": first["id"], **box})
    assert by_item.status_code == 200 and by_item.json()["cosine"] == pytest.approx(
        answer.json()["cosine"], abs=1e-3
    )
    outside = client.post(
        "/v1/explain", params={"item": second["id"], "box": "0,0,5000,5000"}, files={"image": query}
    )
    assert (outside.status_code, outside.json()["error"]["code"]) == (422, "box_outside_image")


def test_unknown_items_and_bad_requests(make_client: Callable[..., TestClient], served: Served) -> None:
    client = make_client()
    item = client.get("/v1/items", params={"limit": 1}).json()["items"][0]
    unknown = client.get("/v1/explain", params={"item": 987654, "query_item": item["id"]})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "item_not_found")
    unknown_query = client.get("/v1/explain", params={"item": item["id"], "query_item": 987654})
    assert unknown_query.status_code == 404 and "987654" in unknown_query.json()["error"]["message"]
    no_item = client.post("/v1/explain", files={"image": (served.gallery / item["path"]).read_bytes()})
    assert no_item.status_code == 422
    not_an_image = client.post("/v1/explain", params={"item": item["id"]}, files={"image": b"not an image"})
    assert not_an_image.status_code == 400


def test_a_model_exported_without_explainer_gets_a_clear_422(
    make_client: Callable[..., TestClient], served: Served, small_model: Path, tmp_path: Path
) -> None:
    index = tmp_path / "old_index"
    build_index(served.gallery, Embedder(small_model, threads=1), index, progress=False)
    client = make_client(index_path=index, model_path=None)
    item = client.get("/v1/items", params={"limit": 1}).json()["items"][0]
    answer = client.get("/v1/explain", params={"item": item["id"], "query_item": item["id"]})
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "explain_unavailable"
    assert "re-export" in answer.json()["error"]["message"]
    assert client.get(f"/v1/items/{item['id']}/similar").status_code == 200  # search still serves
