"""Uploads in phone formats: HEIC and AVIF queries and items, recognised by content whatever their name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from PIL import features

from tests.helpers import API_KEY, Served, image_bytes, make_image

KEY = {"X-API-Key": API_KEY}


@pytest.mark.parametrize(("fmt", "suffix"), [("HEIF", ".heic"), ("AVIF", ".avif")])
def test_phone_formats_are_added_and_searched(
    make_client: Callable[..., TestClient], served: Served, fmt: str, suffix: str
) -> None:
    if fmt == "AVIF" and not features.check("avif"):
        pytest.skip("this Pillow was built without libavif")
    client = make_client(api_key=API_KEY)
    data = image_bytes(make_image(61, size=(300, 200)), fmt, quality=90)
    # Named .jpg on purpose: the stored file gets the suffix of what it really is.
    added = client.post("/v1/items", files={"images": ("photo.jpg", data)}, headers=KEY)
    assert added.status_code == 201, added.text
    item = added.json()["items"][0]
    assert item["path"].endswith(suffix)
    assert (served.gallery / item["path"]).read_bytes() == data
    hit = client.post("/v1/search", params={"k": 1}, files={"image": ("q", data)}).json()["results"][0]
    assert hit["id"] == item["id"] and hit["score"] == pytest.approx(1.0, abs=1e-4)
    thumbnail = client.get(f"/v1/items/{item['id']}/thumbnail")
    assert thumbnail.status_code == 200 and thumbnail.headers["content-type"] == "image/jpeg"


def test_a_text_file_named_heic_is_refused(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    response = client.post("/v1/search", files={"image": ("photo.heic", b"not a picture at all")})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "not_an_image"
