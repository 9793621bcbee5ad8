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
from engine.build.indexing import build_index
from engine.decode.images import decode_image
from engine.duplicates.signature import perceptual_signature
from engine.model.embedder import Embedder
from foundation.defaults import TRASH_FOLDER
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
    trash = served.gallery / response.json()["trash"]
    assert response.json()["set_aside"] == ["cat/00_crop.jpg"]
    assert not (served.gallery / "cat/00_crop.jpg").exists()
    assert (trash / "cat/00_crop.jpg").read_bytes() == query, "set aside, never erased"
    reopened = GalleryIndex.open(served.index)
    assert len(reopened) == reopened.manifest.count == 77
    reopened.close()


def test_deleted_items_stay_deleted_through_build_index_and_come_back_with_the_undo(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    """Issue 42, finding 2: three items deleted through the API, then ``build-index`` of the same folder
    into the same index (what "indexed 3 images" brought back), then the undo of each delete."""
    client = make_client(api_key=API_KEY)
    items = client.get("/v1/items", params={"limit": 100}).json()["items"]
    gone = {item["id"]: item["path"] for item in items[:3]}
    query_item = items[3]["id"]
    judged = client.post(
        "/v1/feedback", json={"query_item": query_item, "result": items[0]["id"], "sign": 1}, headers=KEY
    )
    assert judged.status_code == 201, judged.text
    plans = []
    for item_id in gone:
        response = client.delete(f"/v1/items/{item_id}", headers=KEY)
        assert response.status_code == 200, response.text
        plans.append(response.json()["plan_id"])
    assert client.get("/v1/feedback").json()["total"] == 0  # deleted with its item

    report = build_index(served.gallery, Embedder(served.model), served.index, progress=False)
    assert report.indexed == 0
    reopened = GalleryIndex.open(served.index)
    assert len(reopened) == 75 and not reopened.items.get_many(list(gone))
    reopened.close()

    client = make_client(api_key=API_KEY)  # the index on disk was saved by the build
    for plan_id in plans:
        undone = client.post("/v1/duplicates/undo", json={"plan_id": plan_id}, headers=KEY)
        assert undone.status_code == 200, undone.text
        assert undone.json()["restored"] == 1 and undone.json()["reindexed"] == 0
    for item_id, path in gone.items():  # under the ids they had
        assert client.get(f"/v1/items/{item_id}").json()["path"] == path
        assert (served.gallery / path).is_file()
    feedback = client.get("/v1/feedback").json()["judgments"]
    assert [(j["id"], j["result"], j["query_item"]) for j in feedback] == [
        (judged.json()["id"], items[0]["id"], query_item)
    ]  # back with its item
    assert client.get("/v1/stats").json()["count"] == 78


def test_a_delete_takes_the_byte_copies_of_its_photo_along(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    """A copy of the photo under another name would be indexed in its place by the next build."""
    client = make_client(api_key=API_KEY)
    item = client.get("/v1/items", params={"limit": 1}).json()["items"][0]
    copy = served.gallery / "copies" / "again.jpg"
    copy.parent.mkdir()
    copy.write_bytes((served.gallery / item["path"]).read_bytes())
    response = client.delete(f"/v1/items/{item['id']}", headers=KEY)
    assert response.status_code == 200, response.text
    assert sorted(response.json()["set_aside"]) == sorted([item["path"], "copies/again.jpg"])
    assert not copy.exists()
    report = build_index(served.gallery, Embedder(served.model), served.index, progress=False)
    assert report.indexed == 0 and not report.duplicates


def test_a_delete_that_cannot_set_the_photo_aside_removes_nothing(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    """A gallery whose trash cannot be written (here a file takes the trash folder's name; a read-only
    folder fails the same way): a 503 saying so, the item and its file where they were."""
    (served.gallery / TRASH_FOLDER).write_text("not a folder")
    client = make_client(api_key=API_KEY)
    item = client.get("/v1/items", params={"limit": 1}).json()["items"][0]
    response = client.delete(f"/v1/items/{item['id']}", headers=KEY)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "storage_unavailable"
    assert "was not deleted" in response.json()["error"]["message"]
    assert client.get(f"/v1/items/{item['id']}").status_code == 200
    assert (served.gallery / item["path"]).is_file()


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
