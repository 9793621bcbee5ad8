"""Judgments through the API: POST, GET and DELETE /v1/feedback, kept in the served index's items.sqlite."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable

from fastapi.testclient import TestClient

from bench.lib.images import image_bytes, make_image
from index.gallery import GalleryIndex
from tests.support.served import Served
from tests.support.servers import API_KEY

KEY = {"X-API-Key": API_KEY}


def _ids(client: TestClient) -> list[int]:
    return [item["id"] for item in client.get("/v1/items", params={"limit": 10}).json()["items"]]


def test_judgments_are_kept_paged_deleted_and_survive_a_reload(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    client = make_client(api_key=API_KEY)
    ids = _ids(client)
    fingerprint = client.get("/v1/stats").json()["model_fingerprint"]
    by_item = client.post(
        "/v1/feedback", json={"query_item": ids[0], "result": ids[1], "sign": 1}, headers=KEY
    )
    assert by_item.status_code == 201, by_item.text
    kept = by_item.json()
    assert {key: kept[key] for key in ("query_item", "query_hash", "result", "sign")} == {
        "query_item": ids[0],
        "query_hash": None,
        "result": ids[1],
        "sign": 1,
    }
    assert kept["model_fingerprint"] == fingerprint and kept["query_embedded"] is False
    data = image_bytes(make_image(70))
    upload = client.post(
        "/v1/feedback",
        json={"query_image": base64.b64encode(data).decode(), "result": ids[2], "sign": -1},
        headers=KEY,
    )
    assert upload.status_code == 201, upload.text
    assert upload.json()["query_hash"] == hashlib.sha256(data).hexdigest()
    assert upload.json()["query_embedded"] is True and upload.json()["query_item"] is None
    third = client.post(
        "/v1/feedback", json={"query_item": ids[3], "result": ids[4], "sign": -1}, headers=KEY
    )
    assert third.status_code == 201

    page = client.get("/v1/feedback", params={"offset": 1, "limit": 1}).json()  # no key needed to read
    assert page["total"] == 3 and page["offset"] == 1
    assert [j["id"] for j in page["judgments"]] == [upload.json()["id"]]

    assert client.post("/v1/admin/reload", headers=KEY).status_code == 200
    listed = client.get("/v1/feedback").json()["judgments"]
    assert [j["id"] for j in listed] == [kept["id"], upload.json()["id"], third.json()["id"]]

    deleted = client.delete(f"/v1/feedback/{kept['id']}", headers=KEY)
    assert deleted.status_code == 200 and deleted.json()["deleted"]["id"] == kept["id"]
    again = client.delete(f"/v1/feedback/{kept['id']}", headers=KEY)
    assert again.status_code == 404 and again.json()["error"]["code"] == "judgment_not_found"
    # Deleting an item deletes the judgments naming it.
    assert client.delete(f"/v1/items/{ids[4]}", headers=KEY).status_code == 200
    assert [j["id"] for j in client.get("/v1/feedback").json()["judgments"]] == [upload.json()["id"]]

    index = GalleryIndex.open(served.index, read_only=True)  # kept with the index, on disk
    try:
        (stored,) = index.judgments.scan()
        assert stored.query.embedding is not None and stored.result == ids[2] and stored.sign == -1
    finally:
        index.close()


def test_bad_feedback_is_refused_in_the_json_error_format(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_key=API_KEY)
    ids = _ids(client)
    missing = 10**12

    def post(body: dict[str, object], headers: dict[str, str] = KEY) -> tuple[int, str]:
        response = client.post("/v1/feedback", json=body, headers=headers)
        return response.status_code, response.json()["error"]["code"]

    assert post({"query_item": ids[0], "result": missing, "sign": 1}) == (404, "item_not_found")
    assert post({"query_item": missing, "result": ids[0], "sign": 1}) == (404, "item_not_found")
    assert post({"query_item": ids[0], "result": 2**63, "sign": 1}) == (404, "item_not_found")  # past int64
    for sign in (0, 2, -2, "up"):
        assert post({"query_item": ids[0], "result": ids[1], "sign": sign}) == (422, "invalid_request")
    image = base64.b64encode(image_bytes(make_image(71))).decode()
    both = {"query_item": ids[0], "query_image": image, "result": ids[1], "sign": 1}
    assert post(both) == (422, "invalid_request")
    assert post({"result": ids[1], "sign": 1}) == (422, "invalid_request")
    assert post({"query_image": "not base64!", "result": ids[1], "sign": 1}) == (422, "invalid_request")
    not_an_image = base64.b64encode(b"no image").decode()
    refused = client.post("/v1/search", json={"image": not_an_image})  # as a search refuses it
    assert post({"query_image": not_an_image, "result": ids[1], "sign": 1}) == (
        refused.status_code,
        refused.json()["error"]["code"],
    )
    assert post({"query_item": ids[0], "result": ids[1], "sign": 1}, {}) == (401, "missing_api_key")
    assert post({"query_item": ids[0], "result": ids[1], "sign": 1}, {"X-API-Key": "wrong"}) == (
        401,
        "invalid_api_key",
    )
    assert client.delete("/v1/feedback/1").status_code == 401
    assert client.get("/v1/feedback").json() == {"judgments": [], "total": 0, "offset": 0}
    keyless = make_client()
    response = keyless.post(
        "/v1/feedback", json={"query_item": ids[0], "result": ids[1], "sign": 1}, headers=KEY
    )
    assert response.status_code == 403 and response.json()["error"]["code"] == "writes_disabled"


def test_the_served_schema_describes_the_feedback_routes(make_client: Callable[..., TestClient]) -> None:
    schema = make_client(api_key=API_KEY).get("/openapi.json").json()
    post = schema["paths"]["/v1/feedback"]["post"]
    assert {"201", "401", "403", "404", "413", "422"} <= set(post["responses"])
    body = schema["components"]["schemas"]["FeedbackIn"]["properties"]
    assert body["sign"]["enum"] == [1, -1]
    assert body["query_image"]["anyOf"][0] == {"type": "string", "contentEncoding": "base64"}
    assert {"200", "401", "404"} <= set(schema["paths"]["/v1/feedback/{judgment_id}"]["delete"]["responses"])
    listing = schema["paths"]["/v1/feedback"]["get"]
    assert {p["name"] for p in listing["parameters"]} == {"offset", "limit"}
