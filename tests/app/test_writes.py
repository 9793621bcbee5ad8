"""Adding and removing items: the API key, persistence on disk, and concurrent writes during searches."""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import ExifTags, Image

from bench.lib.images import image_bytes, make_image
from engine.decode.images import decode_image
from engine.duplicates.signature import perceptual_signature
from index.gallery import GalleryIndex
from tests.support.served import Served
from tests.support.servers import ADDRESS_SPACE_CAP, API_KEY, uvicorn_server

KEY = {"X-API-Key": API_KEY}


def test_writes_are_disabled_without_a_configured_key(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    files = {"images": ("new.png", image_bytes(make_image(40)))}
    response = client.post("/v1/items", files=files, headers=KEY)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "writes_disabled"
    assert client.delete("/v1/items/3", headers=KEY).status_code == 403
    assert client.get("/v1/stats").json()["count"] == 78


def test_one_content_is_one_item_whatever_the_label_and_its_case(
    make_client: Callable[..., TestClient],
) -> None:
    """Before: the same bytes under 7 labels became 7 items, `CAT` and `cat` among them."""
    client = make_client(api_key=API_KEY)
    data = image_bytes(make_image(45))
    first = client.post("/v1/items", files={"images": ("a.png", data)}, data={"label": "cat"}, headers=KEY)
    assert first.status_code == 201, first.text
    (item,) = first.json()["items"]
    for label in ("CAT", "Cat", "dog", "cat", "b", "c"):
        again = client.post(
            "/v1/items", files={"images": ("a.png", data)}, data={"label": label}, headers=KEY
        )
        assert again.status_code == 409, (label, again.text)
        assert again.json()["error"]["code"] == "duplicate_item"
        assert f"as item {item['id']}" in again.json()["error"]["message"]
    other = client.post(
        "/v1/items",
        files={"images": ("b.png", image_bytes(make_image(46)))},
        data={"label": "CAT"},
        headers=KEY,
    )
    assert other.status_code == 201, other.text
    assert other.json()["items"][0]["label"] == "cat"  # the stored label, as a label filter matches it
    assert client.get("/v1/stats").json()["count"] == 80


def test_added_items_are_stored_searchable_and_persisted(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    client = make_client(api_key=API_KEY)
    exif = Image.Exif()
    exif.get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.DateTimeOriginal] = "2019:07:14 09:30:00"
    new = [
        image_bytes(make_image(41, size=(200, 150)), "JPEG", exif=exif),
        image_bytes(make_image(42), "PNG"),
    ]
    response = client.post(
        "/v1/items",
        files=[("images", ("a.jpg", new[0])), ("images", ("b.png", new[1]))],
        data={"label": "fresh"},
        headers=KEY,
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["count"] == 80
    added = body["items"]
    assert [item["label"] for item in added] == ["fresh", "fresh"]
    assert added[0]["taken"] == "2019-07-14T09:30:00"  # the upload's EXIF capture time
    assert added[1]["taken"][:10] == dt.datetime.now().date().isoformat()  # none: the file is new now
    assert added[0]["path"].startswith("fresh/") and added[0]["path"].endswith(".jpg")
    assert (served.gallery / added[1]["path"]).read_bytes() == new[1]
    hit = client.post("/v1/search", params={"k": 1}, files={"image": ("q.png", new[1])}).json()["results"][0]
    assert hit["id"] == added[1]["id"] and hit["score"] == pytest.approx(1.0, abs=1e-4)
    assert client.get(f"/v1/items/{added[0]['id']}/image").content == new[0]
    again = client.post(
        "/v1/items", files={"images": ("b.png", new[1])}, data={"label": "fresh"}, headers=KEY
    )
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "duplicate_item"
    twice = [("images", ("c.jpg", new[0])), ("images", ("d.jpg", image_bytes(make_image(44))))] * 2
    repeated = client.post("/v1/items", files=twice, headers=KEY)
    assert repeated.status_code == 409
    assert client.get("/v1/stats").json()["count"] == 80  # nothing of the refused request was added
    unlabelled = client.post(
        "/v1/items", json={"images": [base64.b64encode(image_bytes(make_image(43))).decode()]}, headers=KEY
    )
    assert unlabelled.status_code == 201
    assert unlabelled.json()["items"][0]["label"] is None
    assert "/" not in unlabelled.json()["items"][0]["path"]

    reopened = GalleryIndex.open(served.index)  # what a restarted server would load
    assert len(reopened) == reopened.manifest.count == 81
    assert reopened.items.get(added[0]["id"]).label == "fresh"
    signatures = reopened.signatures()  # from the upload's own decode, like a build's
    reopened.close()
    assert signatures[added[1]["id"]] == perceptual_signature(decode_image(new[1]))


def test_deleted_items_leave_the_results_and_the_saved_index(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    client = make_client(api_key=API_KEY)
    query = (served.gallery / "cat/00_crop.jpg").read_bytes()
    top = client.post("/v1/search", params={"k": 1}, files={"image": ("q.jpg", query)}).json()["results"][0]
    response = client.delete(f"/v1/items/{top['id']}", headers=KEY)
    assert response.status_code == 200
    assert response.json()["deleted"]["path"] == "cat/00_crop.jpg"
    assert response.json()["count"] == 77
    after = client.post("/v1/search", params={"k": 100}, files={"image": ("q.jpg", query)}).json()["results"]
    assert top["id"] not in [r["id"] for r in after]
    assert client.get(f"/v1/items/{top['id']}").status_code == 404
    assert client.delete(f"/v1/items/{top['id']}", headers=KEY).status_code == 404
    assert (served.gallery / "cat/00_crop.jpg").exists(), "the gallery file is kept"
    reopened = GalleryIndex.open(served.index)
    assert len(reopened) == reopened.manifest.count == 77
    reopened.close()


@pytest.mark.server
def test_concurrent_writes_and_searches_on_a_real_server(served: Served) -> None:
    """Searches keep answering while items are added and removed; the saved index ends consistent."""
    args = ["--index", str(served.index), "--model", str(served.model), "--rate-limit", "0"]
    query = (served.gallery / "coffee/01_crop.jpg").read_bytes()
    env = {"DMLSEARCH_API_KEY": API_KEY}
    with (
        uvicorn_server(args, env, address_space=ADDRESS_SPACE_CAP) as url,
        httpx.Client(timeout=60) as http,
    ):

        def search(_: int) -> int:
            return http.post(
                f"{url}/v1/search", params={"k": 5}, files={"image": ("q.jpg", query)}
            ).status_code

        def add(seed: int) -> int:
            files = {"images": (f"{seed}.png", image_bytes(make_image(seed)))}
            return http.post(f"{url}/v1/items", files=files, data={"label": "added"}, headers=KEY).status_code

        def delete(item_id: int) -> int:
            return http.delete(f"{url}/v1/items/{item_id}", headers=KEY).status_code

        with ThreadPoolExecutor(max_workers=8) as pool:
            searches = pool.map(search, range(24))
            adds = pool.map(add, range(500, 506))
            deletes = pool.map(delete, range(10, 14))
            statuses = (list(searches), list(adds), list(deletes))
        assert statuses == ([200] * 24, [201] * 6, [200] * 4)
        assert http.get(f"{url}/v1/stats").json()["count"] == 78 + 6 - 4
        # No answer names a deleted item any more.
        for item_id in range(10, 14):
            assert http.get(f"{url}/v1/items/{item_id}").status_code == 404
        results = http.post(f"{url}/v1/search", params={"k": 100}, files={"image": ("q.jpg", query)})
        assert not {r["id"] for r in results.json()["results"]} & set(range(10, 14))
    reopened = GalleryIndex.open(served.index)
    # The database, the vectors and the manifest agree.
    assert len(reopened) == len(reopened.items) == reopened.manifest.count == 80
    assert sum(1 for i in range(1, 200) if (item := reopened.items.get(i)) and item.label == "added") == 6
    reopened.close()


def test_labels_are_stored_in_nfc(make_client: Callable[..., TestClient], served: Served) -> None:
    client = make_client(api_key=API_KEY)
    files = {"images": ("a.png", image_bytes(make_image(45)))}
    response = client.post("/v1/items", files=files, data={"label": "cafe\u0301"}, headers=KEY)
    assert response.status_code == 201, response.text
    (item,) = response.json()["items"]
    assert item["label"] == "caf\u00e9" and item["path"].startswith("caf\u00e9/")
    assert (served.gallery / item["path"]).is_file()
