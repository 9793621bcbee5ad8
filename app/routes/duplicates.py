"""Near-duplicate groups of the indexed images, paged."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from app.deps import INT64_MAX, Compute, Service, require_api_key
from app.schemas import (
    AppliedPlanOut,
    DuplicateGroupOut,
    DuplicateOut,
    DuplicatesOut,
    ErrorOut,
    EvidenceOut,
    LeftOut,
    PlanIn,
    Responses,
    ReviewOut,
    TierName,
    UndoIn,
    UndoneOut,
)
from engine.duplicates.groups import DEFAULT_MAX_DISTANCE, MAX_DISTANCE_LIMIT
from engine.duplicates.tiers import Tier
from foundation.defaults import TRASH_FOLDER

router = APIRouter(tags=["duplicates"])
ERRORS: Responses = {code: {"model": ErrorOut} for code in (422, 429, 503)}


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
    tier: Annotated[
        TierName | None,
        Query(
            description="Group by tier (exact, edited or similar; each includes the stricter ones), with "
            "each group's tier, each item's evidence and the keeper rule's proposal; threshold and "
            "max_distance are then the tier defaults'."
        ),
    ] = None,
) -> DuplicatesOut:
    """Groups of near-duplicate images (joined by pairs whose perceptual signatures match and whose cosine
    is >= threshold), largest first.

    The first request for a setting finds every group; later pages of the same index state come from
    memory. Images indexed without a signature are judged by cosine alone (``unsigned``, ``note``).
    """
    if tier is not None:
        return await _tiered(service, compute, Tier.parse(tier), offset, limit)
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


async def _tiered(service: Service, compute: Compute, tier: Tier, offset: int, limit: int) -> DuplicatesOut:
    page = (await compute.run(service.duplicates.tiered_page, tier, offset, limit))[0]
    found, settings = page.found, page.found.settings
    groups = [
        DuplicateGroupOut(
            size=len(group.members),
            tier=group.tier.label,
            reason=group.reason,
            items=[
                DuplicateOut(
                    id=m.item.id,
                    path=m.item.path,
                    label=m.item.label,
                    byte_copy=m.byte_copy,
                    score=m.evidence.cosine,
                    evidence=EvidenceOut(
                        pairs_with=m.evidence.other,
                        tier=m.evidence.tier.label,
                        signature_bits=m.evidence.bits,
                        cosine=m.evidence.cosine,
                        hash=m.evidence.digest,
                        alignment=m.evidence.alignment,
                    ),
                    review=ReviewOut(
                        content_hash=m.item.content_hash,
                        pixels=m.facts.pixels,
                        width=m.facts.width,
                        height=m.facts.height,
                        bytes=m.facts.size,
                        camera=m.facts.camera,
                        date=m.facts.date,
                        dated_by=m.facts.dated_by,
                        action=m.action,
                    ),
                )
                for m in group.members
            ],
        )
        for group in page.groups
    ]
    return DuplicatesOut(
        threshold=settings.edited_cosine,
        max_distance=settings.edited_bits,
        unsigned=found.unsigned,
        note=None,
        criteria=found.criteria,
        total=len(found.groups),
        offset=offset,
        groups=groups,
        tier=tier.label,
        keeper_rule=list(page.keeper_rule),
    )


@router.post(
    "/v1/duplicates/apply",
    response_model=AppliedPlanOut,
    responses={
        **{code: {"model": ErrorOut} for code in (401, 403, 422, 429, 503)},
        409: {
            "model": ErrorOut,
            "description": "`not_a_file`: a member to set aside is a folder, a FIFO or a device",
        },
    },
    dependencies=[Depends(require_api_key)],
)
async def apply_plan(plan: PlanIn, service: Service, compute: Compute) -> AppliedPlanOut:
    """Apply a duplicates plan (``X-API-Key`` required): each ``set_aside`` member's file is moved into
    the trash folder inside the gallery and its item removed from the index (a byte copy's item stays; an
    item whose byte copy is kept now names the copy); nothing is deleted. The plan is written into the
    trash folder: ``POST /v1/duplicates/undo`` with its ``plan_id`` (or ``dmlsearch duplicates --undo
    PLAN_ID``) puts the files and their items back. Applying a plan again is harmless."""
    report = (await compute.run(service.duplicates.apply, plan.model_dump()))[0]  # PlanError: 422 or 409
    return AppliedPlanOut(
        moved=report.moved,
        already=report.already,
        left=[LeftOut(path=path, reason=reason) for path, reason in report.left],
        removed=report.removed,
        handed=report.handed,
        trash=f"{TRASH_FOLDER}/{plan.plan_id}",
        plan_id=plan.plan_id,
        count=len(service.index),
    )


@router.post(
    "/v1/duplicates/undo",
    response_model=UndoneOut,
    responses={code: {"model": ErrorOut} for code in (401, 403, 404, 422, 429, 503)},
    dependencies=[Depends(require_api_key)],
)
async def undo_plan(undo: UndoIn, service: Service, compute: Compute) -> UndoneOut:
    """Undo an apply (``X-API-Key`` required), from the plan its trash folder holds: each set-aside file
    goes back to its place and its item back into the index under the id it had (404: no apply of that
    plan id). A complete undo removes the apply's trash folder, leaving no trace: undoing it again is a
    404."""
    report = (await compute.run(service.duplicates.undo, undo.plan_id))[0]
    return UndoneOut(
        moved=report.moved,
        already=report.already,
        left=[LeftOut(path=path, reason=reason) for path, reason in report.left],
        restored=report.restored,
        reindexed=report.reindexed,
        count=len(service.index),
    )
