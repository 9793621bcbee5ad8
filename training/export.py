"""Export an :class:`EmbeddingModel` to ``model.onnx`` + ``model.json``, atomically.

An explainable model (``training.model.explainable``: the pretrained backbone, or it with the residual
head) also outputs its feature map and gets its explainer graph, ``<model>.explain.onnx`` beside it,
named with its fingerprint in the card: the server splits a similarity over image positions with it
(``/v1/explain``).

A run trained with the pddm loss also exports its PDDM unit, as ``<model>.pddm.onnx`` beside the model,
named with its fingerprint in the card: the server re-ranks search candidates with it (``rerank=pddm``).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model.model_card import (
    EMBEDDINGS_OUTPUT,
    EXPLAINER_OUTPUTS,
    MAPS_OUTPUT,
    RERANKER_INPUTS,
    RERANKER_OUTPUT,
    ExplainerCard,
    ModelCard,
    Preprocessing,
    RerankerCard,
    ValidationCheck,
    file_fingerprint,
)
from foundation.atomic import atomic_path
from training.backbone import BACKBONES, create_backbone, split_backbone
from training.losses.pddm import PDDMUnit
from training.model import (
    EmbeddingModel,
    EmbeddingsAndMaps,
    PositionContributions,
    build_objective,
    explainable,
)
from training.run_dir import RunDirectory

ONNX_OPSET = 17


def export_onnx(
    model: nn.Module,
    model_path: Path,
    *,
    preprocessing: Preprocessing,
    backbone: str,
    head: str = "none",
    loss: str | None = None,
    run: str | None = None,
    extra: dict[str, Any] | None = None,
    reranker: RerankerCard | None = None,
    validation_check: ValidationCheck | None = None,
) -> ModelCard:
    """Trace ``model`` (TorchScript exporter, dynamic batch axis) and write the ONNX file and its card.

    ``reranker``: a unit already exported beside ``model_path`` (:func:`export_pddm_unit`). An explainable
    model also gets its explainer (:func:`export_explainer`) and the feature map as a second output. The
    card is written last, so an interrupted export never leaves a card naming files that are not in place.
    """
    model = model.eval()
    example = torch.zeros(2, 3, preprocessing.input_size, preprocessing.input_size)
    with torch.no_grad():
        embedding_dim = int(model(example).shape[1])
    explainer = None
    outputs = [EMBEDDINGS_OUTPUT]
    if explainable(model):
        explainer = export_explainer(model, example, explainer_path_for(model_path))
        # A new wrapper starts in training mode, which the exporter restores after tracing: to the whole
        # model, batch norms included. Wrappers are made in eval mode.
        model, outputs = EmbeddingsAndMaps(model).eval(), [EMBEDDINGS_OUTPUT, MAPS_OUTPUT]
    with atomic_path(model_path) as temporary, torch.no_grad():
        torch.onnx.export(
            model,
            (example,),
            str(temporary),
            input_names=["images"],
            output_names=outputs,
            dynamic_axes={"images": {0: "batch"}, **{name: {0: "batch"} for name in outputs}},
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
        fingerprint = file_fingerprint(temporary)
    card = ModelCard(
        embedding_dim=embedding_dim,
        preprocessing=preprocessing,
        fingerprint=fingerprint,
        backbone=backbone,
        head=head,
        loss=loss,
        run=run,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        extra=extra or {},
        reranker=reranker,
        explainer=explainer,
        validation_check=validation_check,
    )
    card.save(model_path)
    return card


def explainer_path_for(model_path: Path) -> Path:
    """Where a model's explainer goes: ``model.onnx`` -> ``model.explain.onnx`` in the same folder."""
    return model_path.with_name(f"{model_path.stem}.explain.onnx")


def export_explainer(model: EmbeddingModel, example: torch.Tensor, path: Path) -> ExplainerCard:
    """Trace the explainer (:class:`PositionContributions`) of ``model``, atomically to ``path``."""
    with torch.no_grad():
        maps = EmbeddingsAndMaps(model).eval()(example)[1]
    contributions_name, rest_name = EXPLAINER_OUTPUTS
    with atomic_path(path) as temporary, torch.no_grad():
        torch.onnx.export(
            PositionContributions(model).eval(),
            (maps,),
            str(temporary),
            input_names=[MAPS_OUTPUT],
            output_names=list(EXPLAINER_OUTPUTS),
            dynamic_axes={
                MAPS_OUTPUT: {0: "batch"},
                contributions_name: {0: "batch"},
                rest_name: {0: "batch"},
            },
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
        fingerprint = file_fingerprint(temporary)
    return ExplainerCard(file=path.name, fingerprint=fingerprint, grid=(maps.shape[2], maps.shape[3]))


class PDDMScorer(nn.Module):
    """The PDDM unit as an exported graph: queries (q, d) and their candidates (q, k, d) -> S (q, k)."""

    def __init__(self, unit: PDDMUnit) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, queries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        return self.unit.score(queries, candidates)


def pddm_path_for(model_path: Path) -> Path:
    """Where a model's PDDM unit goes: ``model.onnx`` -> ``model.pddm.onnx`` in the same folder."""
    return model_path.with_name(f"{model_path.stem}.pddm.onnx")


def export_pddm_unit(unit: PDDMUnit, path: Path) -> RerankerCard:
    """Trace the full unit (no dropout), with dynamic query and candidate axes, atomically to ``path``."""
    scorer = PDDMScorer(unit).eval()
    queries, candidates = torch.randn(2, unit.dim), torch.randn(2, 3, unit.dim)
    queries_name, candidates_name = RERANKER_INPUTS
    with atomic_path(path) as temporary, torch.no_grad():
        torch.onnx.export(
            scorer,
            (queries, candidates),
            str(temporary),
            input_names=list(RERANKER_INPUTS),
            output_names=[RERANKER_OUTPUT],
            dynamic_axes={
                queries_name: {0: "queries"},
                candidates_name: {0: "queries", 1: "candidates"},
                RERANKER_OUTPUT: {0: "queries", 1: "candidates"},
            },
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
        fingerprint = file_fingerprint(temporary)
    return RerankerCard(kind="pddm", file=path.name, fingerprint=fingerprint)


def export_run(run_path: Path, model_path: Path, *, check: ValidationCheck | None = None) -> ModelCard:
    """Export a training run's best checkpoint: backbone + head + L2 normalisation in one ONNX graph.

    A frozen-mode run trained the head only, so its graph uses the pretrained backbone; a fine-tuned run
    brings its own backbone weights. The card records the loss, the run and its validation metrics, and
    the PDDM unit when the loss trained one (it scores the exported, L2-normalised embeddings: the unit
    normalises its inputs itself, so the training loss's ``embedding_scale`` does not change its scores).
    ``check``: the export's validation check of the run, recorded in the card (a failed one marks a model
    exported with --force).
    """
    run = RunDirectory(run_path)
    config = run.require_config()
    best = run.require_best()
    spec = BACKBONES[config.backbone]
    objective = build_objective(config, spec.feature_dim)
    objective.load_state_dict(best.objective)
    if config.mode == "finetune":
        backbone = objective.backbone
    else:
        backbone = create_backbone(config.backbone)
        if config.mode == "partial":
            split_backbone(config.backbone, backbone)[1].load_state_dict(objective.backbone.state_dict())
    head = objective.head
    unit = getattr(objective.loss, "unit", None)
    reranker = export_pddm_unit(unit, pddm_path_for(model_path)) if isinstance(unit, PDDMUnit) else None
    return export_onnx(
        EmbeddingModel(backbone, head),
        model_path,
        preprocessing=spec.preprocessing,
        backbone=config.backbone,
        head=f"residual-mlp({head.in_dim}->{head.hidden}->{head.out_dim})+pca-linear",
        loss=config.loss,
        run=str(run_path.resolve()),
        extra={
            "mode": config.mode,
            "recipe": (config.recipe or {}).get("name"),
            # When the selected checkpoint was written: the model's training date (the card's
            # `created` is the export's).
            "trained": dt.datetime.fromtimestamp(
                run.checkpoint_path("best").stat().st_mtime, dt.UTC
            ).isoformat(timespec="seconds"),
            "best_step": best.step,
            "val": best.val,
        },
        reranker=reranker,
        validation_check=check,
    )
