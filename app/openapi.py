"""The OpenAPI schema as this server answers it: every route's own contract, plus what the server around the
routes does to any request (middleware, validation, limits from the settings), so that the schema allows
nothing the server refuses and documents every status it answers with.

New routes get the common responses here without listing them; they list only their own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI

from app.context import AppContext
from app.settings import Settings
from app.uploads import IMAGE_FIELDS, bound_upload_counts

ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorOut"}
_PER_OPERATION = "parameters", "requestBody"

# Responses any operation can give, whatever its route: (status, description, applies-to-the-operation).
# The error codes are those of app.errors, app.middleware and app.uploads.
_COMMON_ERRORS: list[tuple[int, str, Callable[[dict[str, Any], Settings], bool]]] = [
    (
        400,
        "`bad_request`: a Content-Length that is not a number, or a malformed multipart body",
        lambda operation, _: True,
    ),
    (
        400,
        "`empty_image`, `not_an_image`, `corrupt_image`: an uploaded image that is empty, is no image or "
        "does not decode (no schema can say that bytes decode as an image); `invalid_base64`: a JSON image "
        "that is not strict base64",
        lambda operation, _: _takes_images(operation),
    ),
    (
        404,
        "`unknown_label`: a label filter naming a label no item has (the message lists those there are)",
        lambda operation, _: any(p["name"] == "label" for p in operation.get("parameters", [])),
    ),
    (
        408,
        "`request_timeout`: the request arrived too slowly: headers past header_timeout_seconds, or a body "
        "that paused past body_timeout_seconds, fell that far behind min_upload_bytes_per_second (or behind "
        "it at all while a new upload needed its slot) or missed body_deadline_seconds; the connection is "
        "closed",
        lambda operation, _: True,
    ),
    (
        413,
        "`request_too_large`: a body over max_request_bytes (by Content-Length, or as it streams in)",
        lambda operation, _: True,
    ),
    (
        422,
        "`invalid_request`: a parameter or body field outside this schema (the message names it)",
        lambda operation, _: any(operation.get(part) for part in _PER_OPERATION),
    ),
    (
        422,
        "`box_inverted`, `box_outside_image`, `box_too_small`: a box the pattern takes that is inverted or "
        "empty (5,5,5,5), reaches outside the image, or is too small (a pattern cannot compare the numbers, "
        "nor know the image's size)",
        lambda operation, _: any(p["name"] == "box" for p in operation.get("parameters", [])),
    ),
    (
        429,
        "`rate_limited`: over this client's request rate (Retry-After says when to come back)",
        lambda operation, settings: settings.rate_limit_per_second > 0,
    ),
    (
        503,
        "the server's state, never the request's: `busy` (too many uploads in progress), `not_ready`, "
        "`out_of_memory`, `embed_timeout`, `shutting_down`, `index_unavailable`, `deadline_exceeded` (an "
        "index on Milvus: its deadline passed while it waited for a compute slot), `preempted` (stopped in "
        "the background for a client with nothing under way) or `storage_unavailable`; Retry-After where "
        "waiting helps",
        lambda operation, _: True,
    ),
]


def served_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` for this server: FastAPI's schema of the routes, completed per request (the served
    model and the settings decide some limits)."""
    static = app.openapi

    def openapi() -> dict[str, Any]:
        schema = copy.deepcopy(static())
        context = AppContext.of(app)
        settings, service = context.settings, context.engine.service
        rerankers = service.rerankers if service is not None else []
        for operation in _operations(schema):
            _add_common_errors(operation, settings)
            _bound_search(operation, settings, rerankers)
            for content in operation.get("requestBody", {}).get("content", {}).values():
                bound_upload_counts(content["schema"], settings.max_batch)
        return schema

    return openapi


def _takes_images(operation: dict[str, Any]) -> bool:
    """Whether the operation's body carries images (an upload: multipart or base64 JSON)."""
    contents = operation.get("requestBody", {}).get("content", {}).values()
    return any(set(IMAGE_FIELDS) & set(content["schema"].get("properties", {})) for content in contents)


def _operations(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for path in schema["paths"].values():
        yield from path.values()


def _add_common_errors(operation: dict[str, Any], settings: Settings) -> None:
    """The responses the server around the routes gives, added to those the route lists; every error,
    a route's own included, has the one error body (FastAPI would document its own 422 shape)."""
    responses = operation.setdefault("responses", {})
    for status, description, applies in _COMMON_ERRORS:
        if applies(operation, settings):
            entry = responses.setdefault(str(status), {"description": description})
            said = entry.get("description", "")
            if said in ("", HTTPStatus(status).phrase, "Validation Error"):  # FastAPI's words for it
                entry["description"] = description
            elif description not in said:
                entry["description"] = f"{said}; {description}"
    for status, entry in responses.items():
        if status.startswith(("4", "5")):
            entry["content"] = {"application/json": {"schema": ERROR_SCHEMA}}


def _bound_search(operation: dict[str, Any], settings: Settings, rerankers: list[str]) -> None:
    """A search's ``k`` and ``offset`` go up to the settings' ``max_k`` and ``max_offset``, and ``rerank``
    offers the re-rankers of the model served now (none: no ``rerank`` parameter)."""
    parameters = operation.get("parameters", [])
    if not any(p["name"] == "min_score" for p in parameters):
        return
    for parameter in parameters:
        limit = {"k": settings.max_k, "offset": settings.max_offset}.get(parameter["name"])
        if limit is not None:
            parameter["schema"]["maximum"] = limit
    for parameter in [p for p in parameters if p["name"] == "rerank"]:
        if rerankers:
            parameter["schema"] = {"anyOf": [{"enum": rerankers, "type": "string"}, {"type": "null"}]}
        else:
            parameters.remove(parameter)
