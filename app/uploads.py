"""Read query or gallery images from a request: multipart uploads or base64 in JSON, with size limits."""

from __future__ import annotations

import base64
import binascii
import re
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser, parse_options_header

from app.errors import ApiError
from app.schemas import ImageJsonIn, ImagesJsonIn, NewItemsJsonIn, SearchJsonIn
from engine.decode.images import IMAGE_MEDIA_TYPES
from engine.gallery.labels import LABEL_PATTERN, MAX_LABEL_BYTES, MAX_LABEL_CHARS
from foundation import defaults
from foundation.errors import ErrorKind

_DATA_URL_PREFIX = re.compile(r"^data:[\w/+.-]*;base64,")
_LABEL_FIELD = "label"
# The label fields of the upload bodies: multipart's (repeated) and JSON's.
_LABEL_FIELDS = (_LABEL_FIELD, "labels")
# The image fields of the upload bodies, multipart and JSON.
IMAGE_FIELDS = ("images", "image")
# The example images that refine a search (engine.serve.refine), named alike in multipart and JSON.
POSITIVE_FIELD, NEGATIVE_FIELD = "positive_images", "negative_images"
_EXAMPLE_FIELDS = (POSITIVE_FIELD, NEGATIVE_FIELD)
_LABEL_RULE = (
    f"each 1-{MAX_LABEL_CHARS} characters and at most {MAX_LABEL_BYTES} bytes in UTF-8 (after Unicode NFC)"
)
# A file part: an image of a format the server decodes (by its content; the part's type is not read).
_FILE_PART_ENCODING = {"contentType": ", ".join(IMAGE_MEDIA_TYPES)}
_LABEL_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_CHARS, "pattern": LABEL_PATTERN}


@dataclass(frozen=True)
class Uploads:
    images: list[bytes]
    labels: list[str | None]
    elapsed_ms: float  # time spent receiving and parsing the body
    positive: list[bytes] = field(default_factory=list)  # uploaded examples (a search's only)
    negative: list[bytes] = field(default_factory=list)


def request_body_spec(
    field: str,
    json_model: type[BaseModel],
    *,
    many: bool,
    labelled: bool = False,
    examples: bool = False,
) -> dict:
    """OpenAPI ``requestBody`` for a route that takes images as multipart uploads or as base64 JSON.

    A multipart field sent once reads as one value, so a field that may repeat takes one value or an
    array of them; each file part is an image of a format the server decodes (``encoding``: a JSON Schema
    cannot say "decodes as an image", a media type can). The counts that depend on the settings are
    added by :func:`bound_upload_counts`. ``examples``: also the positive and negative example images of
    a refined search.
    """
    file_schema: dict[str, Any] = {"type": "string", "format": "binary", "minLength": 1}
    properties: dict[str, Any] = {field: _one_or_many(file_schema) if many else file_schema}
    encoding = {field: _FILE_PART_ENCODING}
    if examples:
        for name, what in ((POSITIVE_FIELD, "more"), (NEGATIVE_FIELD, "less")):
            properties[name] = {
                **_one_or_many(file_schema, max_items=defaults.MAX_EXAMPLES),
                "description": f"{what} like these: example images refining the search (with the ids of "
                f"the {name.split('_')[0]} parameter, at most {defaults.MAX_EXAMPLES} examples in all)",
            }
            encoding[name] = _FILE_PART_ENCODING
    if labelled:
        properties[_LABEL_FIELD] = {
            **_one_or_many(_LABEL_SCHEMA),
            "description": f"no label, one label for every image, or one per image (in order; another "
            f"count is 422 invalid_request); {_LABEL_RULE}",
        }
    multipart = {
        "type": "object",
        "properties": properties,
        "required": [field],
        "additionalProperties": False,
    }
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": multipart, "encoding": encoding},
                "application/json": {"schema": json_model.model_json_schema()},
            },
        }
    }


def _one_or_many(schema: dict[str, Any], max_items: int | None = None) -> dict[str, Any]:
    many: dict[str, Any] = {"type": "array", "items": schema, "minItems": 1}
    if max_items is not None:
        many["maxItems"] = max_items
    return {"anyOf": [schema, many]}


def bound_upload_counts(body: dict[str, Any], max_batch: int) -> None:
    """Complete an upload body's schema (multipart or JSON) with what the settings bound: at most
    ``max_batch`` images, and so at most ``max_batch`` labels. (That labels number none, one or one per
    image is in words, and another count is 422: a JSON Schema cannot tie one array's length to another's,
    and one branch per count is more than generators take.)"""
    properties = body.get("properties", {})
    images: dict[str, Any] = next((properties[name] for name in IMAGE_FIELDS if name in properties), {})
    labels: dict[str, Any] = next((properties[name] for name in _LABEL_FIELDS if name in properties), {})
    for schema in [images, *images.get("anyOf", []), labels, *labels.get("anyOf", [])]:
        if schema.get("type") == "array":
            schema["maxItems"] = max_batch


async def read_uploads(
    request: Request,
    *,
    field: str,
    json_model: type[BaseModel],
    max_count: int,
    max_bytes: int,
    examples: bool = False,
) -> Uploads:
    """The images (and labels) of a request; :class:`ApiError` 4xx for anything malformed or too big.
    ``examples``: also the example images of a refined search (``positive_images``, ``negative_images``)."""
    started = time.perf_counter()
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type == "multipart/form-data":
        images, labels, shown = await _read_multipart(request, field, max_count, max_bytes, examples)
    elif media_type == "application/json":
        images, labels, shown = _read_json(await request.body(), json_model, max_count, max_bytes)
    else:
        raise ApiError(
            ErrorKind.UNSUPPORTED,
            "unsupported_media_type",
            f"send multipart/form-data with the file field {field!r}, or application/json with base64 images",
        )
    if not images:
        raise ApiError(
            ErrorKind.INVALID,
            "invalid_request",
            f"no image in the request: send each in the file field {field!r} ({_curl(field)})",
        )
    _check_count(len(images), max_count)
    if labels and len(labels) not in (1, len(images)):
        raise ApiError(
            ErrorKind.INVALID,
            "invalid_request",
            f"{len(labels)} labels for {len(images)} images: give none, one, or one each",
        )
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    return Uploads(images, labels, elapsed_ms, shown.get(POSITIVE_FIELD, []), shown.get(NEGATIVE_FIELD, []))


def _curl(field: str) -> str:
    return f"curl -F {field}=@photo.jpg"


def _check_count(count: int, max_count: int) -> None:
    if count > max_count:
        raise ApiError(
            ErrorKind.INVALID, "too_many_images", f"at most {max_count} image(s) per request, got {count}"
        )


class _ImagePartsParser(MultiPartParser):
    """Parts of the image fields are files, with or without a filename: RFC 7578 (4.2) makes it optional,
    and Starlette would read a part without one as text (and its bytes as UTF-8 or Latin-1)."""

    def __init__(self, fields: tuple[str, ...], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.image_fields = {field.encode() for field in fields}

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._current_part.content_disposition)
        if options.get(b"name") in self.image_fields and b"filename" not in options:
            assert self._current_part.content_disposition is not None  # it named the field
            self._current_part.content_disposition += b'; filename=""'
        super().on_headers_finished()


async def _read_multipart(
    request: Request, field: str, max_count: int, max_bytes: int, examples: bool
) -> tuple[list[bytes], list[str | None], dict[str, list[bytes]]]:
    example_fields = _EXAMPLE_FIELDS if examples else ()
    async with aclosing(request.stream()) as stream:
        # max_files bounds the parts the parser will hold; one more than allowed lets us say "too many".
        # Examples past their limit in all are refused by engine.serve.refine, in words.
        max_files = max_count + 1 + (2 * defaults.MAX_EXAMPLES if examples else 0)
        parser = _ImagePartsParser(
            (field, *example_fields), request.headers, stream, max_files=max_files, max_fields=max_count + 16
        )
        # Keep file parts in memory up to the size accepted anyway: spilling them to a temporary file
        # costs a thread-pool hop per 64 KiB chunk, which under load made a 12-MP upload take ~0.5 s.
        parser.spool_max_size = max_bytes + 1
        try:
            form = await parser.parse()
        except MultiPartException as err:
            raise ApiError(
                ErrorKind.MALFORMED, "bad_request", f"unreadable multipart body: {err.message}"
            ) from None
    try:
        parts = form.getlist(field)
        elsewhere = sorted(
            {key for key, value in form.multi_items() if isinstance(value, UploadFile)}
            - {field, *example_fields}
        )
        if not parts and elsewhere:  # e.g. -F image=@a.jpg sent to the batch endpoint, which reads "images"
            raise ApiError(
                ErrorKind.INVALID,
                "invalid_request",
                f"no image in the file field {field!r}, which this endpoint reads; the request's files are "
                f"in {', '.join(map(repr, elsewhere))}: send each as {_curl(field)}",
            )
        unknown = sorted(set(form.keys()) - {field, _LABEL_FIELD, *example_fields})
        if unknown:
            also = "".join(f", {name!r}" for name in example_fields)
            raise ApiError(
                ErrorKind.INVALID,
                "invalid_request",
                f"unknown form fields {unknown[:5]}: send {field!r}{also} (and label)",
            )
        files = _file_parts(form.getlist(field), field)
        _check_count(len(files), max_count)  # before reading any of them
        example_files = {name: _file_parts(form.getlist(name), name) for name in example_fields}
        images = [await _read_part(part, field, max_bytes) for part in files]
        shown = {
            name: [await _read_part(part, name, max_bytes) for part in parts]
            for name, parts in example_files.items()
        }
        fields = form.getlist(_LABEL_FIELD)
        labels: list[str | None] = [label for label in fields if isinstance(label, str)]
        if len(labels) < len(fields):
            raise ApiError(
                ErrorKind.INVALID, "invalid_request", f"the field {_LABEL_FIELD!r} must be text, not a file"
            )
    finally:
        await form.close()
    return images, labels, shown


def _file_parts(parts: list[UploadFile | str], field: str) -> list[UploadFile]:
    files = [part for part in parts if isinstance(part, UploadFile)]
    if len(files) < len(parts):
        raise ApiError(ErrorKind.INVALID, "invalid_request", f"the field {field!r} must be a file upload")
    return files


async def _read_part(part: UploadFile, field: str, max_bytes: int) -> bytes:
    data = await part.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ApiError(
            ErrorKind.TOO_LARGE, "upload_too_large", f"{part.filename or field} is over {max_bytes} bytes"
        )
    return data


def _read_json(
    body: bytes, json_model: type[BaseModel], max_count: int, max_bytes: int
) -> tuple[list[bytes], list[str | None], dict[str, list[bytes]]]:
    try:
        payload = json_model.model_validate_json(body)
    except ValidationError as err:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
        raise ApiError(ErrorKind.INVALID, "invalid_request", details) from None
    shown: dict[str, list[str]] = {}
    labels: list[str | None] = []
    if isinstance(payload, SearchJsonIn):
        encoded = [payload.image]
        shown = {POSITIVE_FIELD: payload.positive_images, NEGATIVE_FIELD: payload.negative_images}
    elif isinstance(payload, ImageJsonIn):
        encoded = [payload.image]
    elif isinstance(payload, NewItemsJsonIn):
        encoded, labels = payload.images, payload.labels
    elif isinstance(payload, ImagesJsonIn):
        encoded = payload.images
    else:
        raise TypeError(f"no JSON image reader for {json_model.__name__}")
    _check_count(len(encoded), max_count)  # before decoding any of them
    images = [_decode_base64(text, f"image {position}", max_bytes) for position, text in enumerate(encoded)]
    examples = {
        name: [_decode_base64(text, f"{name} {position}", max_bytes) for position, text in enumerate(texts)]
        for name, texts in shown.items()
    }
    return images, labels, examples


def _decode_base64(text: str, named: str, max_bytes: int) -> bytes:
    """``named``: the image as the refusal names it (``image 2``, ``positive_images 0``)."""
    text = _DATA_URL_PREFIX.sub("", text, count=1)
    if len(text) * 3 // 4 > max_bytes + 2:  # refuse before allocating the decoded bytes
        raise ApiError(ErrorKind.TOO_LARGE, "upload_too_large", f"{named} is over {max_bytes} bytes")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ApiError(ErrorKind.MALFORMED, "invalid_base64", f"{named} is not valid base64: {err}") from None
    if len(data) > max_bytes:
        raise ApiError(ErrorKind.TOO_LARGE, "upload_too_large", f"{named} is over {max_bytes} bytes")
    return data
