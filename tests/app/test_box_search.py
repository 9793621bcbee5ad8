"""Search by a region: a box on the query (pixels or fractions of the upright image), on a batch, on a
gallery item, and every way a box is refused (422 naming which)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from bench.lib.images import image_bytes, make_image
from foundation.defaults import MIN_BOX_SIDE
from tests.support.served import Served
from tests.support.servers import API_KEY

CAT = "cat/00_crop.jpg"
COFFEE = "coffee/01_crop.jpg"
CANVAS = (900, 640)
AT = (380, 150)  # where the gallery photo is pasted on the canvas


def pasted(served: Served, relative: str = CAT) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """A gallery photo pasted at full size into a larger unrelated image, and its box there."""
    photo = Image.open(served.gallery / relative).convert("RGB")
    canvas = make_image(5, CANVAS)
    canvas.paste(photo, AT)
    return canvas, (AT[0], AT[1], AT[0] + photo.width, AT[1] + photo.height)


def as_text(box: tuple[float, ...]) -> str:
    return ",".join(f"{value:g}" for value in box)


def top(response: object) -> dict:
    assert response.status_code == 200, response.text
    return response.json()["results"][0]


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


def test_a_box_in_pixels_or_fractions_searches_by_the_region(client: TestClient, served: Served) -> None:
    canvas, box = pasted(served)
    files = {"image": ("q.png", image_bytes(canvas))}
    whole = client.post("/v1/search", params={"k": 78}, files=files)
    in_pixels = top(client.post("/v1/search", params={"box": as_text(box)}, files=files))
    fractions = tuple(value / CANVAS[index % 2] for index, value in enumerate(box))
    in_fractions = top(client.post("/v1/search", params={"box": as_text(fractions)}, files=files))
    # The box holds exactly the photo's pixels: the photo itself comes first, as if it had been sent alone.
    assert in_pixels["path"] == in_fractions["path"] == CAT
    assert in_pixels["score"] == pytest.approx(1.0, abs=1e-3)
    assert in_fractions["score"] == pytest.approx(1.0, abs=1e-3)
    without = {result["path"]: result for result in whole.json()["results"]}[CAT]
    assert without["score"] < 0.9  # the whole canvas is another picture


def test_the_box_is_on_the_upright_image_of_an_exif_rotated_photo(client: TestClient, served: Served) -> None:
    canvas, box = pasted(served)
    # Stored turned a quarter (as a phone writes a portrait photo), EXIF orientation 6 turns it upright.
    stored = canvas.transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = image_bytes(stored, "JPEG", quality=97, exif=exif.tobytes())
    hit = top(client.post("/v1/search", params={"box": as_text(box)}, files={"image": ("q.jpg", data)}))
    assert hit["path"] == CAT
    assert hit["score"] > 0.97  # the JPEG re-encoding, not the box, keeps it below 1


def test_a_batch_takes_one_box_for_all_or_one_box_each(client: TestClient, served: Served) -> None:
    cat, cat_box = pasted(served, CAT)
    coffee, coffee_box = pasted(served, COFFEE)
    files = [("images", ("a.png", image_bytes(cat))), ("images", ("b.png", image_bytes(coffee)))]
    each = client.post(
        "/v1/search/batch", params={"box": [as_text(cat_box), as_text(coffee_box)]}, files=files
    )
    assert each.status_code == 200, each.text
    assert [query["results"][0]["path"] for query in each.json()["queries"]] == [CAT, COFFEE]
    same = client.post("/v1/search/batch", params={"box": as_text(cat_box)}, files=files)
    assert same.status_code == 200, same.text
    first, second = same.json()["queries"]
    assert first["results"][0]["path"] == CAT
    assert second["results"] != each.json()["queries"][1]["results"]  # the cat's box, not the coffee's
    three = client.post("/v1/search/batch", params={"box": [as_text(cat_box)] * 3}, files=files)
    assert three.status_code == 422
    assert three.json()["error"] == {
        "code": "invalid_request",
        "message": "3 boxes for 2 images: give one, or one each",
    }


@pytest.mark.parametrize(
    ("box", "code", "says"),
    [
        ("500,100,400,300", "box_inverted", "x0 < x1 and y0 < y1"),
        ("10,10,10,200", "box_inverted", "inverted or empty"),
        ("800,100,950,300", "box_outside_image", "outside the 900x640 image"),
        ("100,500,300,641", "box_outside_image", "pixels run from 0,0 to 900,640"),
        ("100,100,110,300", "box_too_small", f"minimum of {MIN_BOX_SIDE}x{MIN_BOX_SIDE}"),
        ("0.1,0.1,0.11,0.5", "box_too_small", "9x256 pixels of the 900x640 image"),
    ],
)
def test_each_bad_box_is_a_422_that_says_which(
    client: TestClient, served: Served, box: str, code: str, says: str
) -> None:
    canvas, _ = pasted(served)
    response = client.post("/v1/search", params={"box": box}, files={"image": ("q.png", image_bytes(canvas))})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert says in error["message"]


def test_a_malformed_box_is_refused_by_the_schema_and_a_batch_names_the_image(
    client: TestClient, served: Served
) -> None:
    canvas, _ = pasted(served)
    data = image_bytes(canvas)
    for text in ("1,2,3", "a,b,c,d", "-5,0,100,100", "1,2,3,4,5"):
        response = client.post("/v1/search", params={"box": text}, files={"image": ("q.png", data)})
        assert response.status_code == 422, text
        assert response.json()["error"]["code"] == "invalid_request"
        assert "box" in response.json()["error"]["message"]
    small = image_bytes(make_image(1, (200, 200)))
    files = [("images", ("a.png", data)), ("images", ("b.png", small))]
    batch = client.post("/v1/search/batch", params={"box": "300,100,700,500"}, files=files)
    assert batch.status_code == 422
    assert batch.json()["error"]["code"] == "box_outside_image"
    assert batch.json()["error"]["message"].startswith(
        "image 1: box 300,100,700,500 reaches outside the 200x200"
    )


def test_similar_takes_a_box_on_the_gallery_item(
    make_client: Callable[..., TestClient], served: Served
) -> None:
    client = make_client(api_key=API_KEY)
    canvas, box = pasted(served)
    added = client.post(
        "/v1/items",
        headers={"X-API-Key": API_KEY},
        files={"images": ("scene.png", image_bytes(canvas))},
        data={"label": "scene"},
    )
    assert added.status_code == 201, added.text
    (item,) = added.json()["items"]
    plain = client.get(f"/v1/items/{item['id']}/similar", params={"k": 78}).json()["results"]
    boxed = top(client.get(f"/v1/items/{item['id']}/similar", params={"box": as_text(box)}))
    assert boxed["path"] == CAT
    assert boxed["score"] == pytest.approx(1.0, abs=1e-3)
    assert item["id"] not in [result["id"] for result in plain]
    assert {result["path"]: result["score"] for result in plain}[CAT] < 0.9
    outside = client.get(f"/v1/items/{item['id']}/similar", params={"box": "0,0,901,100"})
    assert outside.status_code == 422
    assert outside.json()["error"]["code"] == "box_outside_image"


def test_a_malformed_box_is_explained_in_words_on_every_route_that_takes_one(client: TestClient) -> None:
    data = image_bytes(make_image(1, (200, 200)))
    answers = {
        "search": client.post("/v1/search", params={"box": "1,2,3"}, files={"image": ("q.png", data)}),
        "batch": client.post(
            "/v1/search/batch", params={"box": "1,2,3"}, files=[("images", ("q.png", data))]
        ),
        "similar": client.get("/v1/items/1/similar", params={"box": "1,2,3"}),
        "explain": client.get("/v1/explain", params={"item": 1, "query_item": 2, "box": "1,2,3"}),
        "explain an upload": client.post(
            "/v1/explain", params={"item": 1, "box": "1,2,3"}, files={"image": ("q.png", data)}
        ),
    }
    for route, answer in answers.items():
        assert answer.status_code == 422, (route, answer.text)
        message = answer.json()["error"]["message"]
        assert "a box is four numbers x0,y0,x1,y1 (left, top, right, bottom)" in message, (route, message)
        assert "e.g. 40,30,200,180 or 0.25,0.2,0.75,0.8; got '1,2,3'" in message, (route, message)
        assert "pattern" not in message and "[0-9]" not in message, (route, message)
    # The schema still states the pattern, and it is the one applied.
    search = client.get("/openapi.json").json()["paths"]["/v1/search"]["post"]
    (box,) = [parameter for parameter in search["parameters"] if parameter["name"] == "box"]
    (pattern,) = re.findall(r'"pattern": ("(?:[^"\\]|\\.)*")', json.dumps(box))
    pattern = json.loads(pattern)
    assert re.fullmatch(pattern, "1,2,3.5,4") and not re.fullmatch(pattern, "1,2,3")
