"""The search model (backbone, optional embedding head, L2 normalisation) and the training objective."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.backbone import create_backbone, split_backbone
from training.config import TrainConfig
from training.heads import ResidualHead
from training.losses import LOSSES, build_loss


class EmbeddingModel(nn.Module):
    """``image -> backbone -> head -> unit vector``; exported to ONNX as one graph."""

    def __init__(self, backbone: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head if head is not None else nn.Identity()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.backbone(images)), dim=1)


class TrainingObjective(nn.Module):
    """What training optimises: ``loss(head(backbone(inputs)), labels, **batch_info)``.

    One module, so that DistributedDataParallel sees every trained parameter (the head, the backbone when
    fine-tuning, and the loss's own parameters such as the PDDM unit) and checkpoints hold all of them.
    ``backbone`` is ``nn.Identity`` when training on cached backbone features. The loss receives the head's
    raw output (losses that need unit vectors normalise themselves; N-pair style losses use the norm), or
    with ``unit`` its L2-normalised direction, the one retrieval compares, times ``scale``: dot-product
    losses (N-pair, ALMN, Angular) see softmax logits that grow with the squared norm, and the
    PCA-initialised head starts with norms below 1, so ``scale`` sets their temperature.

    With ``chunk``, a training forward runs the backbone on ``chunk`` images at a time with activation
    checkpointing: only each chunk's inputs are kept, and its activations are recomputed in the backward,
    one chunk at a time, so memory follows the chunk rather than the batch (a third more compute: one more
    forward). The loss still sees the whole batch's embeddings, exactly as without chunks: batch norm is
    frozen (:meth:`train`), so a chunk's output does not depend on the other images and running statistics
    are not updated twice, and ``torch.utils.checkpoint`` replays the random state (dropout, drop-path) and
    the autocast state of the first forward in the recomputation.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        loss: nn.Module,
        *,
        scale: float = 1.0,
        unit: bool = False,
        chunk: int = 0,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.loss = loss
        self.scale = scale
        self.unit = unit
        self.chunk = chunk

    def train(self, mode: bool = True) -> TrainingObjective:
        """Batch-norm statistics of the backbone stay frozen: class-balanced batches of a few classes
        are not the image distribution they were estimated on (the usual practice in metric learning)."""
        super().train(mode)
        for module in self.backbone.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
        return self

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.chunk and torch.is_grad_enabled() and len(inputs) > self.chunk:
            parts = inputs.split(self.chunk)
            return torch.cat([checkpoint(self._embed, part, use_reentrant=False) for part in parts])
        return self._embed(inputs)

    def _embed(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(inputs))

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, **batch_info: torch.Tensor) -> torch.Tensor:
        # Mixed precision stops at the loss: distances and log-sum-exps want float32, and autocast left on
        # would run the loss's matmuls in half precision (and its custom backwards on mixed dtypes).
        embeddings = self.embed(inputs).float()
        if self.unit:
            embeddings = F.normalize(embeddings, dim=1)
        with torch.autocast(embeddings.device.type, enabled=False):
            return self.loss(self.scale * embeddings, labels, **batch_info)


def loss_hparams(config: TrainConfig) -> dict[str, Any]:
    """The loss's hyperparameters; a loss with an ``embedding_dim`` (PDDM's unit) gets the head's."""
    hparams = dict(config.loss_hparams)
    if "embedding_dim" in LOSSES[config.loss].defaults:
        hparams["embedding_dim"] = config.embedding_dim
    return hparams


def build_objective(config: TrainConfig, feature_dim: int) -> TrainingObjective:
    """Trained backbone part, residual head and loss, freshly initialised from ``config.seed``.

    The backbone part is nothing in frozen mode (inputs are pooled features), the pretrained last stage
    in partial mode (inputs are the maps entering it) and the whole pretrained backbone in finetune mode.
    """
    torch.manual_seed(config.seed)
    backbone: nn.Module = nn.Identity()
    if config.mode != "frozen":
        backbone = create_backbone(config.backbone)
    if config.mode == "partial":
        backbone = split_backbone(config.backbone, backbone)[1]
    head = ResidualHead(feature_dim, config.embedding_dim, config.head_hidden)
    loss = build_loss(config.loss, **loss_hparams(config))
    chunk = config.backbone_chunk if config.mode == "finetune" else 0  # partial: small 7x7 maps, no need
    return TrainingObjective(
        backbone, head, loss, scale=config.embedding_scale, unit=config.unit_embeddings, chunk=chunk
    )
