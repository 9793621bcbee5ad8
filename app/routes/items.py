"""Item routes: metadata, original image and thumbnail; adding and removing items (API key required)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from app.deps import INT64_MAX, AppSettings, Compute, ItemId, Service, require_api_key
from app.schemas import (
    IMAGE_HEADERS,
    AddedItemsOut,
    DeletedItemOut,
    ErrorOut,
    ItemOut,
    ItemPageOut,
    LabelCountOut,
    LabelsOut,
    NewItemsJsonIn,
    Responses,
)
from app.uploads import read_uploads, request_body_spec
from engine.serve.item_writer import NewItem
from foundation import defaults
from foundation.defaults import TRASH_FOLDER

router = APIRouter(tags=["items"])
ERRORS: Responses = {code: {"model": ErrorOut} for code in (400, 404, 422, 429, 503)}
WRITE_ERRORS: Responses = {
    code: {"model": ErrorOut} for code in (400, 401, 403, 404, 409, 413, 415, 422, 429, 503)
}
# Thumbnails are derived from immutable content (the file name is its hash), so clients may keep them.
THUMBNAIL_CACHE = "public, max-age=86400"


@router.get("/v1/items", response_model=ItemPageOut, responses=ERRORS)
def list_items(
    service: Service,
    offset: Annotated[int, Query(ge=0, le=INT64_MAX, description="Skip this many items.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ItemPageOut:
    """A page of indexed items in id order (to browse the gallery or pick a query item)."""
    items, total = service.reader.page(offset, limit)
    return ItemPageOut(items=[ItemOut.of(item) for item in items], total=total, offset=offset)


@router.get("/v1/labels", response_model=LabelsOut, responses=ERRORS)
def list_labels(service: Service) -> LabelsOut:
    """Every label with its number of items (what a label filter can choose from, however large the
    gallery: a page of items shows only some of its labels)."""
    counts = service.reader.label_counts()
    return LabelsOut(labels=[LabelCountOut(label=label, count=count) for label, count in counts.items()])


@router.get("/v1/items/{item_id}", response_model=ItemOut, responses=ERRORS)
def get_item(item_id: ItemId, service: Service) -> ItemOut:
    """One item's metadata."""
    return ItemOut.of(service.reader.item(item_id))


@router.get("/v1/items/{item_id}/image", response_class=FileResponse, responses=ERRORS)
def item_image(item_id: ItemId, service: Service) -> FileResponse:
    """The original gallery file of an item."""
    return FileResponse(service.reader.image_path(item_id), headers=IMAGE_HEADERS)


@router.get("/v1/items/{item_id}/thumbnail", response_class=Response, responses=ERRORS)
async def item_thumbnail(
    request: Request,
    item_id: ItemId,
    service: Service,
    compute: Compute,
    size: Annotated[
        int, Query(ge=16, le=1024, description="Longest side in pixels.")
    ] = defaults.THUMBNAIL_SIZE,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """A JPEG thumbnail of the item's image (EXIF orientation applied)."""
    item = await run_in_threadpool(service.reader.item, item_id)  # waits for a running write: not on the loop
    etag = f'"{item.content_hash[:32]}-{size}"'
    headers = {"ETag": etag, "Cache-Control": THUMBNAIL_CACHE, **IMAGE_HEADERS}
    if if_none_match == etag:
        return Response(status_code=304, headers=headers)
    # Decoding a gallery image (up to the pixel limit) takes a compute slot like a query's does.
    thumbnail, _ = await compute.run_for(request, service.reader.thumbnail, item_id, size)
    return Response(thumbnail, media_type="image/jpeg", headers=headers)


@router.post(
    "/v1/items",
    response_model=AddedItemsOut,
    status_code=201,
    responses=WRITE_ERRORS,
    dependencies=[Depends(require_api_key)],
    openapi_extra=request_body_spec("images", NewItemsJsonIn, many=True, labelled=True),
)
async def add_items(
    request: Request, service: Service, settings: AppSettings, compute: Compute
) -> AddedItemsOut:
    """Add images to the gallery and the index (``X-API-Key`` required).

    Multipart file fields ``images`` plus optional ``label`` fields, or JSON
    ``{"images": ["<base64>", ...], "labels": [...]}``. The files are stored under the gallery folder as
    ``<label>/<content hash>.<ext>``; all images are checked before anything is written.
    """
    uploads = await read_uploads(
        request,
        field="images",
        json_model=NewItemsJsonIn,
        max_count=settings.max_batch,
        max_bytes=settings.max_upload_bytes,
    )
    labels = uploads.labels * len(uploads.images) if len(uploads.labels) == 1 else uploads.labels
    new_items = [
        NewItem(data, labels[position] if labels else None) for position, data in enumerate(uploads.images)
    ]
    added, _ = await compute.run_for(request, service.writer.add, new_items)
    return AddedItemsOut(items=[ItemOut.of(item) for item in added], count=len(service.index))


@router.delete(
    "/v1/items/{item_id}",
    response_model=DeletedItemOut,
    responses=WRITE_ERRORS,
    dependencies=[Depends(require_api_key)],
)
async def delete_item(item_id: ItemId, service: Service, compute: Compute) -> DeletedItemOut:
    """Delete an item (``X-API-Key`` required) so that it stays deleted: its gallery file, and every byte
    copy of it, is moved into the gallery's trash folder (as the duplicate review sets images aside), so
    no later build-index or watch of the folder indexes it again. Nothing is erased:
    ``POST /v1/duplicates/undo`` with the ``plan_id`` puts it back. A gallery folder that cannot be
    written refuses the delete (503), and nothing is removed."""
    removed, _ = await compute.run(service.writer.remove, item_id)
    return DeletedItemOut(
        deleted=ItemOut.of(removed.item),
        set_aside=removed.set_aside,
        trash=None if removed.plan_id is None else f"{TRASH_FOLDER}/{removed.plan_id}",
        plan_id=removed.plan_id,
        count=len(service.index),
    )
