"""Export an :class:`EmbeddingModel` to ``model.onnx`` + ``model.json``, atomically."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import torch
from torch import nn

from engine.model_card import ModelCard, Preprocessing, file_fingerprint
from index.atomic import atomic_path

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
    )
    card.save(model_path)
    return card
