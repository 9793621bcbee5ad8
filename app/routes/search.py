"""Search routes: by an uploaded image, by a batch of images, by an indexed item."""

from __future__ import annotations

from typing import TypeVar

from fastapi import APIRouter, Request

from app.deps import (
    AppMetrics,
    AppSettings,
    Compute,
    Examples,
    ItemId,
    Options,
    QueryBox,
    QueryBoxes,
    Service,
    boxes_for,
    refined,
)
from app.metrics import Metrics
from app.schemas import BatchSearchOut, ErrorOut, ImagesJsonIn, Responses, SearchJsonIn, SearchOut
from app.uploads import read_uploads, request_body_spec
from engine.serve.query import ItemQuery

router = APIRouter(tags=["search"])
AnswerT = TypeVar("AnswerT", SearchOut, BatchSearchOut)
ERRORS: Responses = {code: {"model": ErrorOut} for code in (400, 404, 413, 415, 422, 429, 503)}


@router.post(
    "/v1/search",
    response_model=SearchOut,
    responses=ERRORS,
    openapi_extra=request_body_spec("image", SearchJsonIn, many=False, examples=True),
)
async def search(
    request: Request,
    service: Service,
    options: Options,
    examples: Examples,
    box: QueryBox,
    settings: AppSettings,
    metrics: AppMetrics,
    compute: Compute,
) -> SearchOut:
    """The gallery images most similar to one query image, best first, with cosine scores (re-ordered by
    the model's PDDM unit, with its scores beside them, under ``rerank=pddm``).

    Send the image as a multipart file field ``image`` or as JSON ``{"image": "<base64>"}``. Refine the
    search with examples: item ids in ``positive`` and ``negative``, and images in the file fields (or JSON
    lists of base64) ``positive_images`` and ``negative_images``.
    """
    uploads = await read_uploads(
        request,
        field="image",
        json_model=SearchJsonIn,
        max_count=1,
        max_bytes=settings.max_upload_bytes,
        examples=True,
    )
    options = refined(options, examples, uploads.positive, uploads.negative)
    # Decoding and inference are CPU work: a worker thread keeps the event loop answering meanwhile.
    response, queued_ms = await compute.run_for(
        request, service.queries.search, uploads.images, options, [box]
    )
    return _answer(SearchOut.of(response, {"upload": uploads.elapsed_ms, "queue": queued_ms}), metrics)


@router.post(
    "/v1/search/batch",
    response_model=BatchSearchOut,
    responses=ERRORS,
    openapi_extra=request_body_spec("images", ImagesJsonIn, many=True),
)
async def search_batch(
    request: Request,
    service: Service,
    options: Options,
    boxes: QueryBoxes,
    settings: AppSettings,
    metrics: AppMetrics,
    compute: Compute,
) -> BatchSearchOut:
    """Many query images in one request, embedded as one batch and searched as one batch.

    Send repeated multipart file fields ``images`` or JSON ``{"images": ["<base64>", ...]}``. One bad
    image fails the request with an error naming its position.
    """
    uploads = await read_uploads(
        request,
        field="images",
        json_model=ImagesJsonIn,
        max_count=settings.max_batch,
        max_bytes=settings.max_upload_bytes,
    )
    query_boxes = boxes_for(boxes, len(uploads.images))
    response, queued_ms = await compute.run_for(
        request, service.queries.search, uploads.images, options, query_boxes
    )
    return _answer(BatchSearchOut.of(response, {"upload": uploads.elapsed_ms, "queue": queued_ms}), metrics)


@router.get("/v1/items/{item_id}/similar", response_model=SearchOut, responses=ERRORS)
async def similar(
    request: Request,
    item_id: ItemId,
    service: Service,
    options: Options,
    box: QueryBox,
    metrics: AppMetrics,
    compute: Compute,
) -> SearchOut:
    """Search by an item already in the index (no upload), or by a box on its image; the item itself is
    left out of its results."""
    query = [ItemQuery(item_id)]
    response, queued_ms = await compute.run_for(request, service.queries.search, query, options, [box])
    return _answer(SearchOut.of(response, {"queue": queued_ms}), metrics)


def _answer(body: AnswerT, metrics: Metrics) -> AnswerT:
    """Record the answer's stage times in the metrics and return it."""
    metrics.observe_stages(body.timings_ms)
    return body
