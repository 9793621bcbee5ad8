"""Model commands: export (and, with the training issue, train and eval)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import DEFAULT_MODEL, fail

commands = typer.Typer()


@commands.command()
def export(
    out: Annotated[
        Path, typer.Option(help="Where to write model.onnx (model.json goes beside it).")
    ] = DEFAULT_MODEL,
    backbone: Annotated[str, typer.Option(help="Backbone name.")] = "efficientnet_lite0",
) -> None:
    """Export the pretrained backbone (global-average-pooled features, L2-normalised) to ONNX."""
    from training.backbone import BACKBONES, create_backbone
    from training.export import export_onnx
    from training.model import EmbeddingModel

    if backbone not in BACKBONES:
        raise fail(f"unknown backbone {backbone!r}; choose one of {sorted(BACKBONES)}")
    model = EmbeddingModel(create_backbone(backbone))
    card = export_onnx(model, out, preprocessing=BACKBONES[backbone].preprocessing, backbone=backbone)
    typer.echo(f"wrote {out} ({card.embedding_dim}-d, fingerprint {card.fingerprint[:12]})")
