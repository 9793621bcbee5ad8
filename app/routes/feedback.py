"""Judgment routes: keep a 👍/👎 on a result, delete one (API key required), page through them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request

from app.deps import INT64_MAX, AppSettings, Compute, Service, require_api_key
from app.errors import ApiError
from app.schemas import DeletedJudgmentOut, ErrorOut, FeedbackIn, JudgmentOut, JudgmentPageOut, Responses
from engine.serve.feedback import Feedback
from foundation.errors import ErrorKind

router = APIRouter(tags=["feedback"])
# The routes' own errors (415: an uploaded query in a format not decoded); app.openapi adds those the
# server gives any request (400, 413, 422, 429, 503).
WRITE_ERRORS: Responses = {code: {"model": ErrorOut} for code in (401, 403, 404, 413, 415, 422)}
JudgmentId = Annotated[int, Path(ge=0, le=INT64_MAX, description="The judgment's id.")]


@router.post(
    "/v1/feedback",
    response_model=JudgmentOut,
    status_code=201,
    responses=WRITE_ERRORS,
    dependencies=[Depends(require_api_key)],
)
async def add_feedback(
    body: FeedbackIn, request: Request, service: Service, settings: AppSettings, compute: Compute
) -> JudgmentOut:
    """Keep one judgment with the index (``X-API-Key`` required): 404 ``item_not_found`` for a query item
    or result not in the index; an uploaded query image is decoded and embedded like a search's."""
    if body.query_image is not None and len(body.query_image) > settings.max_upload_bytes:
        raise ApiError(
            ErrorKind.TOO_LARGE, "upload_too_large", f"query_image is over {settings.max_upload_bytes} bytes"
        )
    feedback = Feedback(body.result, body.sign, body.query_item, body.query_image)
    judgment, _ = await compute.run_for(request, service.feedback.judge, feedback)
    return JudgmentOut.of(judgment)


@router.delete(
    "/v1/feedback/{judgment_id}",
    response_model=DeletedJudgmentOut,
    responses=WRITE_ERRORS,
    dependencies=[Depends(require_api_key)],
)
async def delete_feedback(judgment_id: JudgmentId, service: Service, compute: Compute) -> DeletedJudgmentOut:
    """Delete one judgment (``X-API-Key`` required): 404 ``judgment_not_found`` if there is none."""
    removed, _ = await compute.run(service.feedback.remove, judgment_id)
    return DeletedJudgmentOut(deleted=JudgmentOut.of(removed))


@router.get("/v1/feedback", response_model=JudgmentPageOut)
def list_feedback(
    service: Service,
    offset: Annotated[int, Query(ge=0, le=INT64_MAX, description="Skip this many judgments.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JudgmentPageOut:
    """A page of the index's judgments in id order, and how many there are."""
    judgments, total = service.feedback.page(offset, limit)
    return JudgmentPageOut(judgments=[JudgmentOut.of(j) for j in judgments], total=total, offset=offset)
