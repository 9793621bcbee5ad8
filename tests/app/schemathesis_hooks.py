"""Schemathesis hooks for the contract test (``SCHEMATHESIS_HOOKS``): the images it sends are real images.

The schema says what an upload is as far as OpenAPI can: multipart file parts carry the image media types
the server decodes (``encoding.contentType``), and JSON images are base64 (``contentEncoding``). Neither
says "decodes as an image", so schemathesis would send random bytes (or a zip) under ``image/png``, which
the server rightly refuses (400 ``not_an_image``). These hooks give it what the media types name: images
of each format made here with Pillow, of drawn sizes and colours, in multipart parts and in JSON bodies.
The other rules stated only in words are kept the same way: the number of labels, and a query box that
fits its image (a positive case's box is the whole image: boxes are tested against images of known
sizes in tests/app), a reload that names an index directory (a positive case's is the served index,
CONTRACT_INDEX_PATH; a path that is no index is a 422, tested in tests/app/test_reload.py), and a search's
examples: at most MAX_EXAMPLES in all, none both positive and negative (both refusals are tested in
tests/app/test_refine_api.py), each JSON example a real image, and a judgment's one query (an item id or
a real image, not both: refused as 422, tested in tests/app/test_feedback_api.py).
Two artefacts of the generator are corrected: schemathesis 4.32 reads \\p{M} as
U+20D0-U+20FF, unassigned code points included, so positive labels the schema's own validator
(jsonschema-rs, Rust's regex) refuses are replaced; and a multipart part is text, so a negative case
that only changed a text part's JSON type (an integer or null label, sent as the text "1" or "null") sends a
valid request and is dropped.
Everything else of the generated requests (every other field, every negative case) is left as generated.
"""

from __future__ import annotations

import base64
import io
import os

import jsonschema_rs
import schemathesis
from hypothesis import strategies as st
from PIL import Image

from engine.gallery.labels import LABEL_PATTERN
from foundation.defaults import MAX_EXAMPLES

# Media type -> the Pillow format that writes it (those the server decodes and Pillow writes here).
WRITERS = {
    "image/jpeg": "JPEG",
    "image/png": "PNG",
    "image/webp": "WEBP",
    "image/bmp": "BMP",
    "image/gif": "GIF",
    "image/tiff": "TIFF",
}


def _encode(fmt: str, size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, fmt)
    return buffer.getvalue()


def images(fmt: str) -> st.SearchStrategy[bytes]:
    sides = st.integers(min_value=1, max_value=64)
    channel = st.integers(min_value=0, max_value=255)
    return st.builds(_encode, st.just(fmt), st.tuples(sides, sides), st.tuples(channel, channel, channel))


for media_type, pillow_format in WRITERS.items():
    schemathesis.openapi.media_type(media_type, images(pillow_format))

WHOLE_IMAGE_BOX = "0,0,1,1"
RELOAD = "/v1/admin/reload"
FEEDBACK = "/v1/feedback"
LABEL = jsonschema_rs.validator_for({"type": "string", "pattern": LABEL_PATTERN})
LABEL_FIELDS = ("label", "labels")

IMAGE = base64.b64encode(_encode("PNG", (8, 8), (200, 40, 40))).decode("ascii")
# The uploaded examples of a refined search: a positive and a negative one must differ (an image both
# positive and negative is refused).
EXAMPLE_IMAGES = {
    "positive_images": base64.b64encode(_encode("PNG", (8, 8), (40, 200, 40))).decode("ascii"),
    "negative_images": base64.b64encode(_encode("PNG", (8, 8), (40, 40, 200))).decode("ascii"),
}
EXAMPLE_IDS = ("positive", "negative")


def _count(value: object) -> int:
    """How many values a body field carries (a multipart field sent once is one value)."""
    return len(value) if isinstance(value, list) else int(value is not None)


def _one_label_per_image_or_one(body: dict) -> None:
    """Labels number none, one, or one per image: the rule the schema states in words only (a JSON Schema
    cannot tie one array's length to another's). A generated body with another count keeps its first."""
    for images, labels in (("images", "label"), ("images", "labels")):
        given = body.get(labels)
        if isinstance(given, list) and _count(given) not in (0, 1, _count(body.get(images))):
            body[labels] = given[:1]


def _examples_the_server_takes(query: dict, body: object, query_item: object) -> None:
    """A search's examples, ids in the query and images in the body: no id or image both positive and
    negative (the query item of a search by item counts as positive), and at most MAX_EXAMPLES in all
    (positives kept first)."""
    body = body if isinstance(body, dict) else {}
    fields = [(query, name) for name in EXAMPLE_IDS] + [(body, name) for name in EXAMPLE_IMAGES]
    positives = {repr(value) for where, name in fields[::2] for value in _as_list(where.get(name, []))}
    positives.add(repr(query_item))
    room = MAX_EXAMPLES
    for where, name in fields:
        if name not in where:
            continue
        given = _as_list(where[name])
        if name.startswith("negative"):
            given = [value for value in given if repr(value) not in positives]
        where[name], room = given[:room], room - len(given[:room])


def _labels_the_schema_takes(body: dict) -> None:
    for field in LABEL_FIELDS:
        given = body.get(field)
        if isinstance(given, str) and not LABEL.is_valid(given):
            body[field] = "a"
        elif isinstance(given, list):
            body[field] = [
                "a" if isinstance(label, str) and not LABEL.is_valid(label) else label for label in given
            ]


@schemathesis.hook
def filter_case(context: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    negative = case.meta is not None and not case.meta.generation.mode.is_positive
    body = getattr(case.body, "body", case.body)
    if not (negative and (case.media_type or "").startswith("multipart/") and isinstance(body, dict)):
        return True
    values = [value for field in LABEL_FIELDS for value in _as_list(body.get(field))]
    # Sent as text ("null", "1"): a valid label.
    return not any(value is None or isinstance(value, int | float) for value in values)


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and case.query and "box" in case.query:
        case.query["box"] = [WHOLE_IMAGE_BOX] if isinstance(case.query["box"], list) else WHOLE_IMAGE_BOX
    body = getattr(case.body, "body", case.body)  # a multipart body with its parts' media types
    if positive and case.query is not None:
        if case.media_type == "application/json" and isinstance(body, dict):
            for name, image in EXAMPLE_IMAGES.items():
                if isinstance(body.get(name), list):
                    body[name] = [image if isinstance(value, str) else value for value in body[name]]
        _examples_the_server_takes(case.query, body, (case.path_parameters or {}).get("item_id"))
    if not positive or not isinstance(body, dict):
        return case
    if case.operation.path == RELOAD:  # the served index again (its model: the one it carries)
        body.clear()
        body["index_path"] = os.environ["CONTRACT_INDEX_PATH"]
        return case
    if case.operation.path == FEEDBACK:  # the query by item id if one was drawn, else as a real image
        if isinstance(body.get("query_item"), int):
            body.pop("query_image", None)
        else:
            body.pop("query_item", None)
            body["query_image"] = IMAGE
        return case
    _one_label_per_image_or_one(body)
    _labels_the_schema_takes(body)
    if case.media_type == "application/json":
        if isinstance(body.get("image"), str):
            body["image"] = IMAGE
        if isinstance(body.get("images"), list):
            body["images"] = [IMAGE if isinstance(image, str) else image for image in body["images"]]
    return case
