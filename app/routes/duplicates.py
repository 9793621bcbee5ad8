"""Near-duplicate groups of the indexed images, paged."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.deps import INT64_MAX, Compute, Service
from app.schemas import DuplicateGroupOut, DuplicateOut, DuplicatesOut, ErrorOut
from index.duplicates import DEFAULT_MAX_DISTANCE, MAX_DISTANCE_LIMIT

router = APIRouter(tags=["duplicates"])
ERRORS = {code: {"model": ErrorOut} for code in (422, 429, 503)}


@router.get("/v1/duplicates", response_model=DuplicatesOut, responses=ERRORS)
async def duplicates(
    service: Service,
    compute: Compute,
    threshold: Annotated[
        float | None,
        Query(
            ge=-1.0,
            le=1.0,
            description="Cosine at or above which two images may be copies (default: the index's, looser "
            "when every image has a perceptual signature to confirm it).",
        ),
    ] = None,
    max_distance: Annotated[
        int,
        Query(ge=0, le=MAX_DISTANCE_LIMIT, description="Perceptual-signature bits two copies may differ by."),
    ] = DEFAULT_MAX_DISTANCE,
    offset: Annotated[int, Query(ge=0, le=INT64_MAX, description="Skip this many groups.")] = 0,
    limit: Annotated[int, Query(ge=1, le=100, description="Groups per page.")] = 20,
) -> DuplicatesOut:
    """Groups of near-duplicate images (joined by pairs whose perceptual signatures match and whose cosine
    is >= threshold), largest first.

    The first request for a setting finds every group; later pages of the same index state come from
    memory. Images indexed without a signature are judged by cosine alone (``unsigned``, ``note``).
    """
    found = (await compute.run(service.duplicates.page, threshold, offset, limit, max_distance))[0]
    groups = [
        DuplicateGroupOut(
            size=len(row),
            items=[DuplicateOut(id=i.id, path=i.path, label=i.label, score=score) for i, score in row],
        )
        for row in found.rows
    ]
    return DuplicatesOut(
        threshold=found.threshold,
        max_distance=found.max_distance,
        unsigned=found.unsigned,
        note=found.note,
        criteria=found.criteria,
        total=found.total,
        offset=offset,
        groups=groups,
    )
