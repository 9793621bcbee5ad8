"""Near-duplicate groups of the indexed images, paged."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.deps import INT64_MAX, Compute, Service
from app.schemas import DuplicateGroupOut, DuplicateOut, DuplicatesOut, ErrorOut
from index.duplicates import DEFAULT_THRESHOLD

router = APIRouter(tags=["duplicates"])
ERRORS = {code: {"model": ErrorOut} for code in (422, 429, 503)}


@router.get("/v1/duplicates", response_model=DuplicatesOut, responses=ERRORS)
async def duplicates(
    service: Service,
    compute: Compute,
    threshold: Annotated[
        float, Query(ge=-1.0, le=1.0, description="Cosine at or above which two images are duplicates.")
    ] = DEFAULT_THRESHOLD,
    offset: Annotated[int, Query(ge=0, le=INT64_MAX, description="Skip this many groups.")] = 0,
    limit: Annotated[int, Query(ge=1, le=100, description="Groups per page.")] = 20,
) -> DuplicatesOut:
    """Groups of near-duplicate images (connected by pairs with cosine >= threshold), largest first.

    The first request for a threshold finds every group (a k-nearest-neighbour search of every stored
    vector); later pages of the same index state come from memory. 422 for a Milvus index.
    """
    rows, total = (await compute.run(service.duplicates.page, threshold, offset, limit))[0]
    groups = [
        DuplicateGroupOut(
            size=len(row),
            items=[DuplicateOut(id=i.id, path=i.path, label=i.label, score=score) for i, score in row],
        )
        for row in rows
    ]
    return DuplicatesOut(threshold=threshold, total=total, offset=offset, groups=groups)
