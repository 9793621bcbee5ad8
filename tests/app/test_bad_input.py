"""Bad input and faults through a real uvicorn process under the fault suite's memory cap (``prlimit --as``):
the right 4xx JSON error, never a 500, the server keeps answering and the index files stay byte-for-byte
unchanged."""

from __future__ import annotations

import base64
import os
import sqlite3
import struct
import zlib
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from PIL import Image, features

from bench.lib.images import image_bytes, make_image
from tests.support.served import Served, index_digest
from tests.support.servers import ADDRESS_SPACE_CAP, API_KEY, uvicorn_server
from tests.tiers import starts

MAX_UPLOAD = 400_000
MAX_REQUEST = 1_000_000
MAX_PIXELS = 4_000_000
MAX_BATCH = 4


@pytest.fixture(scope="module")
@starts("server")
def server(served_module: Served) -> Iterator[tuple[str, Served]]:
    """A server over a copy of the demo index in which two items point outside the gallery."""
    served = served_module
    outside = served.gallery.parent / "outside.jpg"
    outside.write_bytes(image_bytes(make_image(9), "JPEG"))
    with sqlite3.connect(served.index / "items.sqlite") as db:
        db.execute("UPDATE items SET path = '../outside.jpg' WHERE id = 1")
        (linked,) = db.execute("SELECT path FROM items WHERE id = 2").fetchone()
    (served.gallery / linked).unlink()
    os.symlink(outside, served.gallery / linked)
    args = ["--index", str(served.index), "--model", str(served.model), "--rate-limit", "0"]
    args += ["--max-upload-bytes", str(MAX_UPLOAD), "--max-image-pixels", str(MAX_PIXELS)]
    env = {
        "DMLSEARCH_API_KEY": API_KEY,
        "DMLSEARCH_MAX_REQUEST_BYTES": str(MAX_REQUEST),
        "DMLSEARCH_MAX_BATCH": str(MAX_BATCH),
    }
    with uvicorn_server(args, env, address_space=ADDRESS_SPACE_CAP) as url:
        yield url, served


@pytest.fixture(autouse=True)
def index_is_unchanged_and_server_answers(server: tuple[str, Served]) -> Iterator[None]:
    url, served = server
    before = index_digest(served.index)
    yield
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    assert index_digest(served.index) == before


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def png_header(width: int, height: int) -> bytes:
    """A tiny PNG that claims to be ``width`` x ``height``: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 4096))
        + chunk(b"IEND", b"")
    )


def corrupt_png() -> bytes:
    data = bytearray(image_bytes(make_image(5, size=(200, 200)), "PNG"))
    start = data.index(b"IDAT") + 40
    data[start : start + 200] = bytes(range(200))
    return bytes(data)


def pdf() -> bytes:
    return image_bytes(make_image(6), "PDF")


def jpeg() -> bytes:
    return image_bytes(make_image(7, size=(320, 240)), "JPEG")


BAD_UPLOADS = {
    "zero_bytes": (b"", 400, "empty_image"),
    "text": (b"name,price\nwidget,3\n" * 20, 400, "not_an_image"),
    "pdf": (pdf(), 400, "not_an_image"),
    "corrupt_png": (corrupt_png(), 400, "corrupt_image"),
    "truncated_jpeg": (jpeg()[: len(jpeg()) // 2], 400, "corrupt_image"),
    "jpeg_header_then_garbage": (b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4, 400, None),
    "unsupported_ppm": (image_bytes(make_image(8), "PPM"), 415, "unsupported_format"),
    "unsupported_ico": (image_bytes(make_image(8, size=(64, 64)), "ICO"), 415, "unsupported_format"),
    "over_pixel_limit": (image_bytes(Image.new("L", (4000, 1500)), "PNG"), 413, "image_too_large"),
    "decompression_bomb_header": (png_header(100_000, 100_000), 413, "image_too_large"),
    "over_upload_size": (np.random.default_rng(0).bytes(MAX_UPLOAD + 1), 413, "upload_too_large"),
}


@pytest.mark.parametrize("name", list(BAD_UPLOADS))
def test_bad_uploads_get_the_right_4xx(server: tuple[str, Served], name: str) -> None:
    url, _ = server
    data, status, code = BAD_UPLOADS[name]
    multipart = httpx.post(f"{url}/v1/search", files={"image": ("upload", data)}, timeout=30)
    assert_error(multipart, status, code)
    as_json = httpx.post(f"{url}/v1/search", json={"image": base64.b64encode(data).decode()}, timeout=30)
    assert_error(as_json, status, code)
    add = httpx.post(
        f"{url}/v1/items", files={"images": ("upload", data)}, headers={"X-API-Key": API_KEY}, timeout=30
    )
    assert_error(add, status, code)


def odd_images() -> dict[str, bytes]:
    photo = make_image(11, size=(160, 120))
    grey16 = Image.fromarray(np.asarray(photo.convert("L"), dtype=np.uint16) * 257)
    rgba = photo.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(photo.size))
    frames = [photo, make_image(12, size=(160, 120))]
    animated = image_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    images = {
        "cmyk_jpeg": image_bytes(photo.convert("CMYK"), "JPEG"),
        "16bit_png": image_bytes(grey16, "PNG"),
        "palette_png": image_bytes(photo.convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
        "rgba_png": image_bytes(rgba, "PNG"),
        "greyscale_alpha_png": image_bytes(photo.convert("LA"), "PNG"),
        "animated_gif": animated,
        "tiff": image_bytes(photo, "TIFF"),
        "bmp": image_bytes(photo, "BMP"),
        "progressive_jpeg": image_bytes(photo, "JPEG", progressive=True),
    }
    if features.check("webp"):
        images["webp"] = image_bytes(photo, "WEBP")
    return images


@pytest.mark.parametrize("name", list(odd_images()))
def test_odd_but_valid_images_are_searched(server: tuple[str, Served], name: str) -> None:
    url, _ = server
    response = httpx.post(
        f"{url}/v1/search", params={"k": 3}, files={"image": ("q", odd_images()[name])}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["results"]) == 3


def score_of(url: str, data: bytes, path: str) -> float:
    results = httpx.post(f"{url}/v1/search", params={"k": 1000}, files={"image": ("q.jpg", data)}, timeout=30)
    return next(r["score"] for r in results.json()["results"] if r["path"] == path)


def test_exif_orientation_is_applied_before_embedding(server: tuple[str, Served]) -> None:
    """A sideways-stored photo tagged "rotate 90 CW" finds its upright original; untagged it scores lower."""
    url, served = server
    target = "temple/11_original.jpg"
    sideways = Image.open(served.gallery / target).transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    tagged = score_of(url, image_bytes(sideways, "JPEG", quality=95, exif=exif), target)
    untagged = score_of(url, image_bytes(sideways, "JPEG", quality=95), target)
    assert tagged > 0.97
    assert tagged > untagged + 0.05


def test_request_level_errors(server: tuple[str, Served]) -> None:
    url, _ = server
    image = jpeg()
    assert_error(httpx.post(f"{url}/v1/search", content=image, timeout=30), 415, "unsupported_media_type")
    assert_error(
        httpx.post(f"{url}/v1/search", content=image, headers={"Content-Type": "image/jpeg"}, timeout=30), 415
    )
    assert_error(httpx.post(f"{url}/v1/search", files={"photo": ("q.jpg", image)}, timeout=30), 422)
    form_field = httpx.post(
        f"{url}/v1/search", data={"image": "not a file"}, files={"other": ("x.txt", b"x")}, timeout=30
    )
    assert_error(form_field, 422, "invalid_request")
    url_encoded = httpx.post(f"{url}/v1/search", data={"image": "not a file"}, timeout=30)
    assert_error(url_encoded, 415, "unsupported_media_type")
    assert_error(
        httpx.post(
            f"{url}/v1/search", content=b"{not json", headers={"Content-Type": "application/json"}, timeout=30
        ),
        422,
        "invalid_request",
    )
    assert_error(
        httpx.post(f"{url}/v1/search", json={"image": "%%%not base64%%%"}, timeout=30), 400, "invalid_base64"
    )
    assert_error(httpx.post(f"{url}/v1/search", json={"picture": "AAAA"}, timeout=30), 422, "invalid_request")
    no_boundary = {"Content-Type": "multipart/form-data"}
    assert_error(
        httpx.post(f"{url}/v1/search", content=b"x", headers=no_boundary, timeout=30), 400, "bad_request"
    )
    garbled = {"Content-Type": "multipart/form-data; boundary=b"}
    response = httpx.post(f"{url}/v1/search", content=b"--b\r\ngarbage\r\n", headers=garbled, timeout=30)
    assert_error(response, 400, "bad_request")
    two = [("image", ("a.jpg", image)), ("image", ("b.jpg", image))]
    assert_error(httpx.post(f"{url}/v1/search", files=two, timeout=30), 422, "too_many_images")


def test_batch_errors_name_the_bad_image(server: tuple[str, Served]) -> None:
    url, _ = server
    files = [("images", ("good.jpg", jpeg())), ("images", ("bad.jpg", b"garbage bytes"))]
    error = assert_error(httpx.post(f"{url}/v1/search/batch", files=files, timeout=30), 400, "not_an_image")
    assert error["message"].startswith("image 1:")
    add = httpx.post(f"{url}/v1/items", files=files, headers={"X-API-Key": API_KEY}, timeout=30)
    assert assert_error(add, 400, "not_an_image")["message"].startswith("image 1:")
    # The count is checked before any image is read: garbage past the limit is "too many", not "bad".
    many = [("images", (f"{i}.jpg", b"garbage bytes")) for i in range(MAX_BATCH + 1)]
    assert_error(httpx.post(f"{url}/v1/search/batch", files=many, timeout=30), 422, "too_many_images")
    many_json = {"images": ["%%% not base64 %%%"] * (MAX_BATCH + 1)}
    assert_error(httpx.post(f"{url}/v1/search/batch", json=many_json, timeout=30), 422, "too_many_images")
    assert_error(
        httpx.post(f"{url}/v1/search/batch", json={"images": []}, timeout=30), 422, "invalid_request"
    )
    # The single search's field name sent to the batch endpoint: the answer names both fields.
    wrong_field = httpx.post(f"{url}/v1/search/batch", files={"image": ("q.jpg", jpeg())}, timeout=30)
    message = assert_error(wrong_field, 422, "invalid_request")["message"]
    assert "'images', which this endpoint reads" in message and "are in 'image'" in message
    assert "curl -F images=@photo.jpg" in message


def test_over_size_request_body_is_refused(server: tuple[str, Served]) -> None:
    url, _ = server
    big = np.random.default_rng(1).bytes(MAX_REQUEST + 1000)
    assert_error(
        httpx.post(f"{url}/v1/search", files={"image": ("big.jpg", big)}, timeout=30),
        413,
        "request_too_large",
    )
    chunked = httpx.post(
        f"{url}/v1/search",
        content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert_error(chunked, 413, "request_too_large")


@pytest.mark.parametrize(
    "params",
    [
        {"k": 0},
        {"k": 1001},
        {"k": 2**63},
        {"k": "ten"},
        {"offset": -1},
        {"offset": 2**64},
        {"min_score": 1.5},
        {"min_score": "nan"},
        {"predict": "maybe"},
    ],
)
def test_bad_query_parameters_are_422(server: tuple[str, Served], params: dict) -> None:
    url, _ = server
    search = httpx.post(f"{url}/v1/search", params=params, files={"image": ("q.jpg", jpeg())}, timeout=30)
    assert_error(search, 422, "invalid_request")
    assert_error(httpx.get(f"{url}/v1/items/3/similar", params=params, timeout=30), 422, "invalid_request")


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/items", {"offset": 2**63}),  # SQLite's integers are 64-bit: this was an OverflowError (500)
        ("/v1/items", {"offset": 2**64}),
        ("/v1/items", {"limit": 2**63}),
        ("/v1/items/3/thumbnail", {"size": 2**63}),
        ("/v1/duplicates", {"offset": 2**63}),
    ],
)
def test_huge_integers_are_422(server: tuple[str, Served], path: str, params: dict) -> None:
    url, _ = server
    assert_error(httpx.get(f"{url}{path}", params=params, timeout=30), 422, "invalid_request")


# Before: the first two were 500s (ValueError in chr() past U+10FFFF; a surrogate SQLite cannot store), the
# times OverflowErrors (500): converted to UTC they fall before year 1 or after year 9999.
EDGE_PREFIXES = ["cat%F4%8F%BF%BF", "cat%ED%9F%BF", "%F4%8F%BF%BF%F4%8F%BF%BF", "%00", "cat%EF%BF%BF"]
OUT_OF_RANGE_TIMES = [
    {"added_to": "0001-01-01T00:00:00+14:00"},
    {"added_from": "9999-12-31T23:59:59-14:00"},
    {"added_from": "0001-01-01T00:00:00+14:00", "added_to": "9999-12-31T23:59:59-14:00"},
]


@pytest.mark.parametrize("prefix", EDGE_PREFIXES)
def test_any_path_prefix_is_answered_without_a_500(server: tuple[str, Served], prefix: str) -> None:
    url, _ = server
    for response in (
        httpx.get(f"{url}/v1/items/3/similar?path_prefix={prefix}", timeout=30),
        httpx.post(f"{url}/v1/search?path_prefix={prefix}", files={"image": ("q.jpg", jpeg())}, timeout=30),
    ):
        assert response.status_code == 200, response.text
        assert response.json()["results"] == []  # no gallery path starts with these


@pytest.mark.parametrize("params", OUT_OF_RANGE_TIMES)
def test_times_out_of_range_in_utc_are_422(server: tuple[str, Served], params: dict) -> None:
    url, _ = server
    error = assert_error(httpx.get(f"{url}/v1/items/3/similar", params=params, timeout=30), 422)
    assert "out of range" in error["message"]


def test_the_last_possible_offset_is_an_empty_page(server: tuple[str, Served]) -> None:
    url, _ = server
    page = httpx.get(f"{url}/v1/items", params={"offset": 2**63 - 1}, timeout=30)
    assert page.status_code == 200 and page.json()["items"] == []


@pytest.mark.parametrize("suffix", ["", "/image", "/thumbnail", "/similar"])
def test_unknown_and_malformed_ids(server: tuple[str, Served], suffix: str) -> None:
    url, _ = server
    assert_error(httpx.get(f"{url}/v1/items/999999{suffix}", timeout=30), 404, "item_not_found")
    for bad in ("-1", str(2**64), "abc", "1.5"):
        assert_error(httpx.get(f"{url}/v1/items/{bad}{suffix}", timeout=30), 422, "invalid_request")


@pytest.mark.parametrize("suffix", ["/image", "/thumbnail", "/similar"])
def test_paths_escaping_the_gallery_are_refused(server: tuple[str, Served], suffix: str) -> None:
    """Item 1's stored path is ``../outside.jpg``; item 2's file is a symlink to it: neither is served."""
    url, _ = server
    for item_id in (1, 2):
        response = httpx.get(f"{url}/v1/items/{item_id}{suffix}", timeout=30)
        assert_error(response, 404, "item_not_found")
    for raw in ("/v1/items/..%2F..%2F..%2Fetc%2Fpasswd/image", "/v1/items/3/..%2F..%2F..%2Fetc%2Fpasswd"):
        response = httpx.get(url + raw, timeout=30)
        assert response.status_code in (404, 422), response.text
        assert "root:" not in response.text


def test_writes_need_the_right_key_and_a_safe_label(server: tuple[str, Served]) -> None:
    url, _ = server
    files = {"images": ("new.jpg", jpeg())}
    assert_error(httpx.post(f"{url}/v1/items", files=files, timeout=30), 401, "missing_api_key")
    wrong = {"X-API-Key": "not-the-key"}
    assert_error(
        httpx.post(f"{url}/v1/items", files=files, headers=wrong, timeout=30), 401, "invalid_api_key"
    )
    assert_error(httpx.delete(f"{url}/v1/items/3", headers=wrong, timeout=30), 401, "invalid_api_key")
    assert_error(httpx.delete(f"{url}/v1/items/3", timeout=30), 401, "missing_api_key")
    key = {"X-API-Key": API_KEY}
    assert_error(httpx.delete(f"{url}/v1/items/999999", headers=key, timeout=30), 404, "item_not_found")
    bad_labels = (
        "../escape",
        "a/b",
        ".hidden",
        "..",
        "x" * 101,
        "\U0001d538" * 100,  # 100 characters, 400 bytes: over a file name's 255 (was a 500)
        "LICENSES.md",  # a file in the gallery root (was a 500: FileExistsError)
        "\u202eevil",  # right-to-left override
        "a\u200bb",  # zero-width space
        " ",
        " padded",
        "%2F",
        "tab\there",
    )
    for label in bad_labels:
        response = httpx.post(f"{url}/v1/items", files=files, data={"label": label}, headers=key, timeout=30)
        assert_error(response, 422, "invalid_item")
    mismatched = {"images": ["AAAA", "AAAA"], "labels": ["a", "b", "c"]}
    assert_error(
        httpx.post(f"{url}/v1/items", json=mismatched, headers=key, timeout=30), 422, "invalid_request"
    )


def test_images_say_nosniff_and_405_names_every_method(server: tuple[str, Served]) -> None:
    """Before: image responses had no X-Content-Type-Options, and PUT /v1/items answered 405 with
    'Allow: GET' though POST is allowed too (Starlette named the first route of the path only)."""
    url, _ = server
    for suffix in ("/image", "/thumbnail"):
        response = httpx.get(f"{url}/v1/items/3{suffix}", timeout=30)
        assert response.status_code == 200 and response.headers["X-Content-Type-Options"] == "nosniff"
    refused = assert_error(httpx.put(f"{url}/v1/items", timeout=30), 405, "method_not_allowed")
    assert refused
    allowed = httpx.put(f"{url}/v1/items", timeout=30).headers["Allow"]
    assert {"GET", "POST"} <= {method.strip() for method in allowed.split(",")}
    allowed = httpx.patch(f"{url}/v1/items/3", timeout=30).headers["Allow"]
    assert {"GET", "DELETE"} <= {method.strip() for method in allowed.split(",")}
