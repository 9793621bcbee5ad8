"""Explain routes: why an item matched a query, as two heatmaps (``engine.serve.explain``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from app.deps import INT64_MAX, AppSettings, Compute, QueryBox, Service
from app.schemas import ErrorOut, ExplainOut, HeatmapOut, ImageJsonIn, Responses
from app.uploads import read_uploads, request_body_spec
from engine.decode.regions import Box
from engine.serve.heatmap_image import jpeg_bytes, overlay
from engine.serve.query import ItemQuery
from engine.serve.query import Query as SearchQuery
from engine.serve.search import SearchService

router = APIRouter(tags=["explain"])
ERRORS: Responses = {code: {"model": ErrorOut} for code in (400, 404, 413, 415, 422, 429, 503)}
ItemParam = Annotated[int, Query(ge=0, le=INT64_MAX, description="The result to explain: an item id.")]


@router.post(
    "/v1/explain",
    response_model=ExplainOut,
    responses=ERRORS,
    openapi_extra=request_body_spec("image", ImageJsonIn, many=False),
)
async def explain_upload(
    request: Request,
    item: ItemParam,
    box: QueryBox,
    service: Service,
    settings: AppSettings,
    compute: Compute,
) -> ExplainOut:
    """Why ``item`` matched an uploaded query image: a heatmap over each image whose positions' shares add
    up to their cosine (422 ``explain_unavailable`` when the served model was exported without its
    explainer). Send the image as a multipart file field ``image`` or as JSON ``{"image": "<base64>"}``;
    ``box``: the region of it searched by (as ``/v1/search``'s), whose heatmap is then given.
    """
    uploads = await read_uploads(
        request, field="image", json_model=ImageJsonIn, max_count=1, max_bytes=settings.max_upload_bytes
    )
    return await _explain(request, compute, service, uploads.images[0], item, box)


@router.get("/v1/explain", response_model=ExplainOut, responses=ERRORS)
async def explain_items(
    request: Request,
    item: ItemParam,
    query_item: Annotated[
        int, Query(ge=0, le=INT64_MAX, description="The query: another item's id (its stored image).")
    ],
    box: QueryBox,
    service: Service,
    compute: Compute,
) -> ExplainOut:
    """Why ``item`` matched ``query_item`` (as in ``/v1/items/{query_item}/similar``, with its ``box``):
    both heatmaps."""
    return await _explain(request, compute, service, ItemQuery(query_item), item, box)


async def _explain(
    request: Request, compute: Compute, service: Service, query: SearchQuery, item: int, box: Box | None
) -> ExplainOut:
    # Decoding, the model and the drawing are CPU work: a compute slot, off the event loop.
    explanation, _ = await compute.run_for(request, _explained, service, query, item, box)
    return explanation


def _explained(service: SearchService, query: SearchQuery, item: int, box: Box | None) -> ExplainOut:
    explanation = service.explanations.explain(query, item, box)
    return ExplainOut(
        item_id=item,
        query_item_id=query.item_id if isinstance(query, ItemQuery) else None,
        cosine=explanation.cosine,
        query=HeatmapOut.of(explanation.query, jpeg_bytes(overlay(explanation.query))),
        item=HeatmapOut.of(explanation.item, jpeg_bytes(overlay(explanation.item))),
        model_fingerprint=explanation.model_fingerprint,
        summary=" ".join(explanation.in_words()),
    )
