"""Schemathesis hooks for the contract test (``SCHEMATHESIS_HOOKS``): the base64 images of JSON bodies are
real images.

A JSON Schema can say that a string is base64 (``contentEncoding``) but not that it decodes to an image,
so schemathesis fills it with base64 of random text, which the server rightly refuses (400
``corrupt_image``). For multipart uploads (``format: binary``) schemathesis sends real image files of its
own; this gives JSON bodies the same, leaving every other part of the generated request as it was.
"""

from __future__ import annotations

import base64
import io

import schemathesis
from PIL import Image

_buffer = io.BytesIO()
Image.new("RGB", (8, 8), (200, 40, 40)).save(_buffer, "PNG")
IMAGE = base64.b64encode(_buffer.getvalue()).decode("ascii")


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    body = case.body
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and case.media_type == "application/json" and isinstance(body, dict):
        if isinstance(body.get("image"), str):
            body["image"] = IMAGE
        if isinstance(body.get("images"), list):
            body["images"] = [IMAGE if isinstance(image, str) else image for image in body["images"]]
    return case
