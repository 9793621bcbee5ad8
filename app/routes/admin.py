"""Operator actions: switch the served index (and its model) without a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Body, Depends
from starlette.concurrency import run_in_threadpool

from app.deps import Context, require_api_key
from app.errors import ApiError
from app.reload import ReloadError
from app.schemas import ErrorOut, ReloadIn, ReloadOut

router = APIRouter()


@router.post(
    "/v1/admin/reload",
    response_model=ReloadOut,
    tags=["admin"],
    dependencies=[Depends(require_api_key)],
    responses={code: {"model": ErrorOut} for code in (400, 401, 403, 422)},
)
async def reload(context: Context, body: Annotated[ReloadIn | None, Body()] = None) -> ReloadOut:
    """Load another index directory (default: the configured path again) and swap it in.

    Queries in flight finish on the old index; later ones use the new index and the model it carries.
    If the new index cannot be loaded or fails its probe query (a directory or model named that does not
    exist included), the served one stays and the answer says why: 422 ``reload_failed``.
    """
    body = body or ReloadIn()
    index_path = Path(body.index_path) if body.index_path else None
    model_path = Path(body.model_path) if body.model_path else None
    try:
        result = await run_in_threadpool(context.reloader.reload, index_path, model_path)
    except ReloadError as err:
        raise ApiError(err.kind, err.code, f"still serving the loaded index: {err}") from None
    return ReloadOut(
        status="reloaded",
        index_path=str(result.index_path),
        model_fingerprint=result.model_fingerprint,
        previous_model_fingerprint=result.previous_model_fingerprint,
        count=result.count,
        took_ms=result.took_ms,
    )
