"""Uploads in phone formats: HEIC and AVIF queries and items, recognised by content whatever their name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from PIL import features

from bench.lib.images import image_bytes, make_image
from tests.support.served import Served
from tests.support.servers import API_KEY

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


def test_an_image_part_without_a_filename_is_a_file_and_a_label_part_is_text(
    make_client: Callable[..., TestClient],
) -> None:
    """RFC 7578 makes a part's filename optional: an image sent without one is still the image's bytes
    (Starlette alone would read it as text); a label sent as a file is refused, not stored as no label."""
    client = make_client(api_key=API_KEY)
    data = image_bytes(make_image(62, size=(64, 48)), "PNG")
    boundary = "b0undary"
    image_part = 'Content-Disposition: form-data; name="images"\r\nContent-Type: image/png'
    label_part = 'Content-Disposition: form-data; name="label"\r\n\r\ncat'
    body = (
        f"--{boundary}\r\n{image_part}\r\n\r\n".encode()
        + data
        + f"\r\n--{boundary}\r\n{label_part}\r\n--{boundary}--\r\n".encode()
    )
    headers = {**KEY, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    added = client.post("/v1/items", content=body, headers=headers)
    assert added.status_code == 201, added.text
    assert added.json()["items"][0]["label"] == "cat"
    as_file = client.post(
        "/v1/items", files=[("images", ("a.png", data)), ("label", ("l.txt", b"cat"))], headers=KEY
    )
    assert as_file.status_code == 422 and "must be text" in as_file.json()["error"]["message"]
