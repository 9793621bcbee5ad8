"""FastAPI dependencies shared by the routes: the ready service, query options, the write key.

They are ``async`` because they only read memory: FastAPI would run plain ``def`` dependencies in the
thread pool, one hop each, which cost milliseconds per request on a busy CPU.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import secrets
from collections.abc import Sequence
from typing import Annotated, Literal

from fastapi import Depends, Header, Path, Query, Request
from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

from app.compute import ComputeSlots
from app.context import AppContext
from app.errors import ApiError
from app.metrics import Metrics
from app.settings import Settings
from engine.decode.regions import BOX_FORMAT, Box
from engine.serve.query import SearchOptions
from engine.serve.refine import DEFAULT_STRATEGY, Refinement, Strategy
from engine.serve.search import SearchService
from foundation import defaults
from foundation.errors import ErrorKind
from index.filters import ItemFilter

INT64_MAX = 2**63 - 1


def _iso_time(value: object) -> object:
    """Only ISO 8601 text is a time (what the schema's date-time says): pydantic would also take a number
    as seconds since 1970 (``added_to=0.5``)."""
    return dt.datetime.fromisoformat(value) if isinstance(value, str) else value


IsoTime = Annotated[dt.datetime, BeforeValidator(_iso_time)]

# A calendar date, or a date and a time of day, with no zone: valid dates only (leap years included), so
# that what the pattern allows always parses. [0-9], not \d: Python's \d takes any script's digits.
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
LOCAL_TIME_PATTERN = f"^{_DATE}(?:T(?:[01][0-9]|2[0-3]):[0-5][0-9](?::[0-5][0-9](?:\\.[0-9]{{1,6}})?)?)?$"


def _local_time(value: object) -> object:
    """A time on the camera's clock: the pattern's text only (no zone: those photos have none)."""
    if isinstance(value, str) and re.fullmatch(LOCAL_TIME_PATTERN, value):
        return dt.datetime.fromisoformat(value)
    raise ValueError(f"give a date or a date and time without a zone (2024-06-01T12:30), got {value!r}")


LocalTime = Annotated[
    dt.datetime,
    BeforeValidator(_local_time),
    WithJsonSchema({"type": "string", "pattern": LOCAL_TIME_PATTERN}),
]
ItemId = Annotated[int, Path(ge=0, le=INT64_MAX, description="The item's id in the index.")]
# A query box as the API takes it: four non-negative numbers (engine.decode.regions says what they mean),
# the right and bottom above 0: a box with either at 0 has no area (0,0,0,0), refused by the schema's own
# pattern. Which boxes are inverted, outside the image or too small no pattern can tell: 422, documented.
_NUMBER = r"[0-9]+(\.[0-9]+)?"
_ABOVE_0 = r"([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)"
BOX_PATTERN = rf"^{_NUMBER},{_NUMBER},{_ABOVE_0},{_ABOVE_0}$"


def _box_text(value: str) -> str:
    """The pattern's text only, refused in words (pydantic's own refusal shows the regular expression)."""
    if not re.fullmatch(BOX_PATTERN, value):
        why = f"a box is {BOX_FORMAT}; got {value!r} (its right and bottom are above 0)"
        raise PydanticCustomError("box_format", "{why}", {"why": why})
    return value


BoxText = Annotated[
    str, AfterValidator(_box_text), WithJsonSchema({"type": "string", "pattern": BOX_PATTERN})
]
_BOX_HELP = (
    "Search by a region of the query image: x0,y0,x1,y1 (left, top, right, bottom) in pixels of the upright "
    "image (after EXIF rotation), or as fractions of its width and height when all four are within [0, 1]. "
    f"422 box_inverted, box_outside_image, or box_too_small (under {defaults.MIN_BOX_SIDE} pixels a side)."
)


async def app_context(request: Request) -> AppContext:
    return AppContext.of(request.app)


Context = Annotated[AppContext, Depends(app_context)]


async def get_settings(context: Context) -> Settings:
    return context.settings


async def get_metrics(context: Context) -> Metrics:
    return context.metrics


async def get_compute(context: Context) -> ComputeSlots:
    return context.compute


async def ready_service(context: Context) -> SearchService:
    state = context.engine
    if state.service is None:
        raise ApiError(
            ErrorKind.UNAVAILABLE, "not_ready", f"the search engine is not ready: {state.not_ready_reason}"
        )
    return state.service


async def item_filter(
    label: Annotated[
        list[str] | None, Query(description="Only items with this label (repeat for any of several).")
    ] = None,
    path_prefix: Annotated[
        str | None,
        Query(
            min_length=1,
            description="Only items whose gallery-relative path starts with this (a sub-folder).",
        ),
    ] = None,
    taken_from: Annotated[
        LocalTime | None,
        Query(
            description="Only photos taken at or after this time on the camera's clock (EXIF capture time, "
            "else the file's time; ISO 8601 without a zone, e.g. 2024-06-01)."
        ),
    ] = None,
    taken_to: Annotated[
        LocalTime | None,
        Query(description="Only photos taken before this time on the camera's clock (ISO 8601, no zone)."),
    ] = None,
    added_from: Annotated[
        IsoTime | None,
        Query(
            description="Only items indexed at or after this time (ISO 8601; UTC if no zone). At or after "
            "added_to, the range is empty and so are the results."
        ),
    ] = None,
    added_to: Annotated[
        IsoTime | None, Query(description="Only items indexed before this time (ISO 8601; UTC if no zone).")
    ] = None,
) -> ItemFilter | None:
    try:
        where = ItemFilter(tuple(label or ()), path_prefix, added_from, added_to, taken_from, taken_to)
    except ValueError as err:
        raise ApiError(ErrorKind.INVALID, "invalid_request", str(err)) from None
    return None if where.empty else where


ExampleId = Annotated[int, Field(ge=0, le=INT64_MAX)]
_EXAMPLES_HELP = (
    f"(repeat for several; at most {defaults.MAX_EXAMPLES} positive and negative examples in all). "
    "Examples are left out of the results; 404 item_not_found for an id not in the index, 422 "
    "conflicting_examples for one that is both positive and negative, 422 too_many_examples."
)


async def refinement(
    positive: Annotated[
        list[ExampleId] | None,
        Query(
            max_length=defaults.MAX_EXAMPLES,
            description=f"More like these: ids of items the results should resemble {_EXAMPLES_HELP}",
        ),
    ] = None,
    negative: Annotated[
        list[ExampleId] | None,
        Query(
            max_length=defaults.MAX_EXAMPLES,
            description=f"Less like these: ids of items the results should not resemble {_EXAMPLES_HELP}",
        ),
    ] = None,
    strategy: Annotated[
        Strategy,
        Query(
            description="How the examples combine, as Qdrant's recommendation API defines them (the query "
            "is the first positive example): average_vector searches by 2 avg(positives) - avg(negatives); "
            "best_score rescores the nearest neighbours of each positive by their best cosine to a positive, "
            "or minus the square of their best cosine to a negative where that is higher."
        ),
    ] = DEFAULT_STRATEGY,
) -> Refinement:
    return Refinement(tuple(positive or ()), tuple(negative or ()), strategy)


def refined(
    options: SearchOptions,
    examples: Refinement,
    positive: Sequence[bytes] = (),
    negative: Sequence[bytes] = (),
) -> SearchOptions:
    """``options`` refined by the examples named in the query string and those uploaded (none: as they
    were)."""
    refine = Refinement((*examples.positive, *positive), (*examples.negative, *negative), examples.strategy)
    return dataclasses.replace(options, refine=refine if refine.positive or refine.negative else None)


async def search_options(
    settings: Annotated[Settings, Depends(get_settings)],
    where: Annotated[ItemFilter | None, Depends(item_filter)],
    examples: Annotated[Refinement, Depends(refinement)],
    k: Annotated[
        int, Query(ge=1, le=defaults.MAX_K, description="How many results (per page).")
    ] = defaults.TOP_K,
    min_score: Annotated[
        float,
        Query(
            ge=-1.0,
            le=1.0,
            description="Drop results whose cosine score is below this (the cosine score, with rerank too).",
        ),
    ] = defaults.MIN_SCORE,
    offset: Annotated[
        int,
        Query(
            ge=0,
            description="Skip this many best results (paging). With rerank, pages walk through the "
            "re-ranked candidate pool and end with it.",
        ),
    ] = 0,
    predict: Annotated[
        bool, Query(description="Also predict the query's label by a score-weighted kNN vote.")
    ] = False,
    rerank: Annotated[
        Literal["pddm"] | None,
        Query(
            description="pddm: re-score the top max(rerank_pool, 4k) cosine neighbours (rerank_pool is "
            f"a server setting, {defaults.RERANK_POOL} by default) with the model's learned PDDM unit and "
            "order them by that score; each result then carries pddm_score beside its cosine score. 422 "
            "when the served model has no PDDM unit (see rerankers in /v1/stats)."
        ),
    ] = None,
) -> SearchOptions:
    if k > settings.max_k:
        raise ApiError(ErrorKind.INVALID, "invalid_request", f"k must be at most {settings.max_k}")
    if offset > settings.max_offset:
        raise ApiError(ErrorKind.INVALID, "invalid_request", f"offset must be at most {settings.max_offset}")
    options = SearchOptions(
        k=k, min_score=min_score, offset=offset, predict=predict, rerank=rerank, where=where
    )
    return refined(options, examples)


async def query_box(box: Annotated[BoxText | None, Query(description=_BOX_HELP)] = None) -> Box | None:
    return None if box is None else Box.parse(box)


async def query_boxes(
    box: Annotated[
        list[BoxText] | None,
        Query(description=f"{_BOX_HELP} Give one box for every image, or one per image (in order)."),
    ] = None,
) -> list[Box] | None:
    return None if box is None else [Box.parse(text) for text in box]


def boxes_for(boxes: list[Box] | None, count: int) -> list[Box] | None:
    """One box per query: a single box applies to every image; any other count must match."""
    if boxes is None or len(boxes) == count:
        return boxes
    if len(boxes) == 1:
        return boxes * count
    raise ApiError(
        ErrorKind.INVALID, "invalid_request", f"{len(boxes)} boxes for {count} images: give one, or one each"
    )


async def require_api_key(
    settings: Annotated[Settings, Depends(get_settings)],
    x_api_key: Annotated[str | None, Header(description="The server's API key (writes only).")] = None,
) -> None:
    """Writes need the configured key; with no key configured, writes are off altogether."""
    key = settings.write_key
    if key is None:
        raise ApiError(
            ErrorKind.FORBIDDEN, "writes_disabled", "this server accepts no writes (no API key is configured)"
        )
    if x_api_key is None:
        raise ApiError(ErrorKind.UNAUTHORIZED, "missing_api_key", "send the API key in the X-API-Key header")
    if not secrets.compare_digest(x_api_key.encode(), key.encode()):
        raise ApiError(
            ErrorKind.UNAUTHORIZED, "invalid_api_key", "the X-API-Key header does not match the server's key"
        )


Service = Annotated[SearchService, Depends(ready_service)]
Options = Annotated[SearchOptions, Depends(search_options)]
Examples = Annotated[Refinement, Depends(refinement)]
QueryBox = Annotated[Box | None, Depends(query_box)]
QueryBoxes = Annotated[list[Box] | None, Depends(query_boxes)]
AppSettings = Annotated[Settings, Depends(get_settings)]
AppMetrics = Annotated[Metrics, Depends(get_metrics)]
Compute = Annotated[ComputeSlots, Depends(get_compute)]
