"""The search model: backbone features, an optional embedding head, then L2 normalisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EmbeddingModel(nn.Module):
    """``image -> backbone -> head -> unit vector``; exported to ONNX as one graph."""

    def __init__(self, backbone: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head if head is not None else nn.Identity()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.backbone(images)), dim=1)
