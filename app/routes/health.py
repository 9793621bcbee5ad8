"""Liveness, readiness, index statistics and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from app.deps import AppMetrics, AppSettings, Context, Service
from app.errors import ApiError
from app.schemas import ErrorOut, ModelOut, ReadyOut, StatsOut
from foundation.errors import ErrorKind

router = APIRouter()


@router.get("/healthz", tags=["health"])
async def healthz() -> dict[str, str]:
    """The process is up (it may still be loading or misconfigured: see /readyz)."""
    return {"status": "ok"}


async def taking_uploads(context: Context) -> None:
    """503 ``busy`` while every upload slot is held (on the event loop, which owns the slots)."""
    uploads = context.uploads
    if uploads.full():
        raise ApiError(ErrorKind.UNAVAILABLE, "busy", f"every upload slot is held ({uploads.limit} of them)")


@router.get(
    "/readyz",
    response_model=ReadyOut,
    tags=["health"],
    responses={503: {"model": ErrorOut}},
    dependencies=[Depends(taking_uploads)],
)
def readyz(service: Service) -> ReadyOut:
    """The model and the index are loaded and agree with each other, and an upload would be taken now (503
    with the reason otherwise: `busy` while every upload slot is held, as uploads are then refused)."""
    return ReadyOut(status="ready", model_fingerprint=service.model_fingerprint, count=len(service.index))


@router.get("/v1/stats", response_model=StatsOut, tags=["index"], responses={503: {"model": ErrorOut}})
def stats(service: Service, settings: AppSettings) -> StatsOut:
    """Index size, dimension, type, the model it was built with and its measured recall."""
    manifest = service.index.manifest
    card = service.embedder.card
    return StatsOut(
        count=len(service.index),
        dim=manifest.dim,
        backend=manifest.backend,
        index_type=manifest.built.index_type,
        metric=manifest.metric,
        model_fingerprint=manifest.model_fingerprint,
        achieved_recall=manifest.built.achieved_recall,
        model=ModelOut(
            fingerprint=card.fingerprint,
            backbone=card.backbone,
            head=card.head,
            loss=card.loss,
            embedding_dim=card.embedding_dim,
        ),
        rerankers=service.rerankers,
        writes_enabled=settings.writes_enabled,
    )


@router.get("/metrics", tags=["health"], response_class=Response)
async def metrics(collectors: AppMetrics) -> Response:
    """Prometheus metrics: request latency by route, query latency by stage, rate-limit refusals."""
    return Response(collectors.render(), media_type=collectors.content_type)
