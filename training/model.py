"""The search model (backbone, optional embedding head, L2 normalisation) and the training objective."""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.backbone import create_backbone, split_backbone
from training.config import TrainConfig
from training.heads import NORMALIZE_EPS, ResidualHead
from training.losses import LOSSES, build_loss
from training.losses.base import MetricLoss


class EmbeddingModel(nn.Module):
    """``image -> backbone -> head -> unit vector``; exported to ONNX as one graph."""

    def __init__(self, backbone: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head if head is not None else nn.Identity()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.backbone(images)), dim=1)


class MapAveraging(Protocol):
    """A timm network's two halves: the feature map, and its pooling (with ``pre_logits``, no classifier)."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor: ...


def averages_a_map(backbone: nn.Module) -> TypeGuard[MapAveraging]:
    """Whether ``backbone(x)`` is the average over positions of a feature map, ``forward_features(x)``:
    a timm network with average pooling and no classifier (what :class:`PositionContributions` splits)."""
    pool = getattr(backbone, "global_pool", None)
    get_classifier = getattr(backbone, "get_classifier", None)
    classifier = get_classifier() if callable(get_classifier) else None
    return (
        hasattr(backbone, "forward_features")
        and getattr(pool, "pool_type", None) == "avg"
        and isinstance(classifier, nn.Identity)
        and not getattr(backbone, "drop_rate", 0.0)
    )


def explainable(model: nn.Module) -> TypeGuard[EmbeddingModel]:
    """Whether similarities of ``model`` split exactly over image positions (:class:`PositionContributions`):
    an average-pooled backbone under no head or the residual head."""
    return (
        isinstance(model, EmbeddingModel)
        and averages_a_map(model.backbone)
        and isinstance(model.head, nn.Identity | ResidualHead)
    )


class EmbeddingsAndMaps(nn.Module):
    """An explainable :class:`EmbeddingModel` with its feature map as a second output: ``images ->
    (embeddings, maps)``, the embeddings computed exactly as the model computes them, the maps (n, c, h, w)
    being the backbone's last feature map (the one it averages), a tensor the forward computes anyway."""

    def __init__(self, model: EmbeddingModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        backbone = _map_averaging(self.model)
        maps = backbone.forward_features(images)
        return F.normalize(self.model.head(backbone.forward_head(maps, pre_logits=True)), dim=1), maps


class PositionContributions(nn.Module):
    """``maps -> (contributions, rest)``: the embedding of an explainable model split over map positions.

    With ``g`` the average of the map's ``h*w`` position vectors ``f_p``, the head's output ``z = head(g)``
    is split exactly as ``sum_p s_p + c`` (``ResidualHead.split``; no head: ``s_p = f_p / (h*w)``, ``c = 0``),
    and the embedding ``e = z / |z|`` as ``sum_p s_p / |z| + c / |z|``. ``contributions`` (n, h, w, d) are the
    ``s_p / |z|``, ``rest`` (n, d) is ``c / |z|``. The cosine of this image with any unit vector ``u`` is then
    ``sum_p <contributions_p, u> + <rest, u>``: the heatmap of position ``p`` is its exact share of it.
    """

    def __init__(self, model: EmbeddingModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = _map_averaging(self.model).forward_head(maps, pre_logits=True)
        batch, _, height, width = maps.shape
        parts = maps.flatten(2).transpose(1, 2) / (height * width)  # (n, h*w, c), summing to `pooled`
        head = self.model.head
        if isinstance(head, ResidualHead):
            shares, rest = head.split(pooled, parts)
        else:  # no head: the embedding is the normalised average itself
            shares, rest = parts, torch.zeros_like(pooled)
        norm = head(pooled).norm(dim=1, keepdim=True).clamp_min(NORMALIZE_EPS)  # as F.normalize divides
        contributions = (shares / norm[:, :, None]).reshape(batch, height, width, -1)
        return contributions, rest / norm


def _map_averaging(model: EmbeddingModel) -> MapAveraging:
    if not averages_a_map(model.backbone):
        raise TypeError(f"{type(model.backbone).__name__} does not average a feature map: not explainable")
    return model.backbone


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
        head: ResidualHead,
        loss: MetricLoss,
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
