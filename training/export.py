"""Export an :class:`EmbeddingModel` to ``model.onnx`` + ``model.json``, atomically."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model_card import ModelCard, Preprocessing, file_fingerprint
from index.atomic import atomic_path
from training.backbone import BACKBONES, create_backbone
from training.model import EmbeddingModel, build_objective
from training.run_dir import RunDirectory, RunDirError

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
) -> ModelCard:
    """Trace ``model`` (TorchScript exporter, dynamic batch axis) and write the ONNX file and its card."""
    model = model.eval()
    example = torch.zeros(2, 3, preprocessing.input_size, preprocessing.input_size)
    with torch.no_grad():
        embedding_dim = int(model(example).shape[1])
    with atomic_path(model_path) as temporary, torch.no_grad():
        torch.onnx.export(
            model,
            (example,),
            str(temporary),
            input_names=["images"],
            output_names=["embeddings"],
            dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}},
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
    )
    card.save(model_path)
    return card


def export_run(run_path: Path, model_path: Path) -> ModelCard:
    """Export a training run's best checkpoint: backbone + head + L2 normalisation in one ONNX graph.

    A frozen-mode run trained the head only, so its graph uses the pretrained backbone; a fine-tuned run
    brings its own backbone weights. The card records the loss, the run and its validation metrics.
    """
    run = RunDirectory(run_path)
    config = run.require_config()
    best = run.load_checkpoint("best")
    if best is None:
        raise RunDirError(f"{run_path} has no checkpoints/best.pt yet")
    spec = BACKBONES[config.backbone]
    objective = build_objective(config, spec.feature_dim)
    objective.load_state_dict(best["objective"])
    backbone = objective.backbone if config.mode == "finetune" else create_backbone(config.backbone)
    head = objective.head
    return export_onnx(
        EmbeddingModel(backbone, head),
        model_path,
        preprocessing=spec.preprocessing,
        backbone=config.backbone,
        head=f"residual-mlp({head.in_dim}->{head.hidden}->{head.out_dim})+pca-linear",
        loss=config.loss,
        run=str(run_path.resolve()),
        extra={"mode": config.mode, "best_step": best["step"], "val": best["val"]},
    )
