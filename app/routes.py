"""HTTP routes: thin wrappers over :class:`engine.search.SearchService`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, File, Query, Request, UploadFile
from fastapi.responses import FileResponse

from app.errors import ApiError
from app.schemas import ErrorOut, SearchOut, StatsOut
from app.settings import Settings
from app.state import EngineState
from engine.search import SearchService

router = APIRouter()
ERRORS = {code: {"model": ErrorOut} for code in (400, 404, 413, 415, 422, 503)}


def _service(request: Request) -> SearchService:
    state: EngineState = request.app.state.engine
    if state.service is None:
        raise ApiError(503, "not_ready", f"the search engine is not ready: {state.not_ready_reason}")
    return state.service


def _read_upload(upload: UploadFile, limit: int) -> bytes:
    data = upload.file.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, "upload_too_large", f"the upload is larger than {limit} bytes")
    return data


@router.get("/healthz", tags=["health"])
def healthz() -> dict[str, str]:
    """The process is up (it may still be loading or misconfigured: see /readyz)."""
    return {"status": "ok"}


@router.get("/readyz", tags=["health"], responses={503: {"model": ErrorOut}})
def readyz(request: Request) -> dict[str, str]:
    """The model and the index are loaded and agree with each other."""
    _service(request)
    return {"status": "ready"}


@router.post("/v1/search", response_model=SearchOut, tags=["search"], responses=ERRORS)
def search(
    request: Request,
    image: Annotated[UploadFile, File(description="The query image.")],
    k: Annotated[int, Query(ge=1, le=1000, description="How many results.")] = 10,
    min_score: Annotated[float, Query(ge=-1.0, le=1.0, description="Drop results below this cosine.")] = -1.0,
) -> SearchOut:
    """Top-k gallery images most similar to the uploaded image, with cosine similarity scores."""
    settings: Settings = request.app.state.settings
    if k > settings.max_k:
        raise ApiError(422, "invalid_request", f"k must be at most {settings.max_k}")
    service = _service(request)
    response = service.search(_read_upload(image, settings.max_upload_bytes), k=k, min_score=min_score)
    return SearchOut(
        results=[asdict(result) for result in response.results],
        took_ms=response.took_ms,
        model_fingerprint=response.model_fingerprint,
    )


@router.get("/v1/items/{item_id}/image", tags=["items"], response_class=FileResponse, responses=ERRORS)
def item_image(request: Request, item_id: int) -> FileResponse:
    """The original gallery file of an indexed item."""
    path = _service(request).image_path(item_id)
    if path is None:
        raise ApiError(404, "not_found", f"no image for item {item_id}")
    return FileResponse(path)


@router.get("/v1/stats", response_model=StatsOut, tags=["index"], responses=ERRORS)
def stats(request: Request) -> StatsOut:
    """Index size, dimension, type and the model it was built with."""
    manifest = _service(request).index.manifest
    return StatsOut(
        count=manifest.count,
        dim=manifest.dim,
        backend=manifest.backend,
        index_type=manifest.index_type,
        metric=manifest.metric,
        model_fingerprint=manifest.model_fingerprint,
        achieved_recall=manifest.achieved_recall,
    )
