"""The served model's card and its training run's proof (``dmlsearch eval`` / ``dmlsearch report``).

The card's ``run`` names the run directory the model was exported from; when that directory is on this
server, its eval.json and report plots are served too (only the fixed plot names: no path comes from the
request).
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from app.deps import Service
from app.errors import ApiError
from app.schemas import IMAGE_HEADERS, ErrorOut, ModelCardOut, PlotOut, Responses
from engine.model.model_card import ModelCard
from engine.model.run_proof import EVAL_FILE, PLOTS, REPORT_FILE, plot_path
from foundation.errors import ErrorKind

router = APIRouter(tags=["model"])
ERRORS: Responses = {code: {"model": ErrorOut} for code in (404, 429, 503)}


def _run_dir(card: ModelCard) -> Path | None:
    return Path(card.run) if card.run and Path(card.run).is_dir() else None


def _evaluation(run_dir: Path | None) -> dict | None:
    if run_dir is None or not (run_dir / EVAL_FILE).is_file():
        return None
    try:
        return json.loads((run_dir / EVAL_FILE).read_text())
    except (OSError, ValueError):  # a damaged file is no proof; the card is still worth showing
        return None


@router.get("/v1/model", response_model=ModelCardOut, responses=ERRORS)
def model_card(service: Service) -> ModelCardOut:
    """The served model: backbone, loss, recipe, fingerprint, dates, validation metrics, and the proof
    (eval verdict, report plots) when its training run is on this server."""
    card = service.embedder.card
    run_dir = _run_dir(card)
    plots = [
        PlotOut(name=name, caption=caption, url=f"/v1/model/plots/{name}")
        for name, caption in PLOTS.items()
        if run_dir is not None and plot_path(run_dir, name).is_file()
    ]
    return ModelCardOut(
        fingerprint=card.fingerprint,
        backbone=card.backbone,
        head=card.head,
        loss=card.loss,
        recipe=card.extra.get("recipe"),
        mode=card.extra.get("mode"),
        embedding_dim=card.embedding_dim,
        exported=card.created,
        trained=card.extra.get("trained"),
        run=Path(card.run).name if card.run else None,
        best_step=card.extra.get("best_step"),
        validation=card.extra.get("val", {}),
        validation_check=card.validation_check,
        evaluation=_evaluation(run_dir),
        report_available=run_dir is not None and (run_dir / REPORT_FILE).is_file(),
        plots=plots,
    )


@router.get(
    "/v1/model/plots/{name}",
    response_class=FileResponse,
    responses={**ERRORS, 200: {"content": {"image/png": {}}}},
)
def model_plot(name: str, service: Service) -> FileResponse:
    """One plot of the served model's training report, as PNG (404 without a report)."""
    if name not in PLOTS:
        raise ApiError(
            ErrorKind.NOT_FOUND, "not_found", f"no plot {name!r}; the report has {', '.join(PLOTS)}"
        )
    run_dir = _run_dir(service.embedder.card)
    if run_dir is None or not plot_path(run_dir, name).is_file():
        raise ApiError(
            ErrorKind.NOT_FOUND, "not_found", "the served model's training report is not on this server"
        )
    return FileResponse(plot_path(run_dir, name), media_type="image/png", headers=IMAGE_HEADERS)
