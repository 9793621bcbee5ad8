"""The contract every loss keeps: ``loss(embeddings, labels, **batch_info) -> scalar``.

``batch_info`` carries what a sampler knows about the batch beyond its labels (Magnet's ``cluster_ids``);
a loss takes the keys it uses and ignores the rest, so any sampler can feed any loss. What flows back
from a loss to the sampler is :attr:`MetricLoss.last_sample_losses`, declared here rather than looked
up by name, so that a sampler needs no knowledge of a loss's internals.
"""

from __future__ import annotations

from torch import Tensor, nn


class MetricLoss(nn.Module):
    """Base class of the losses: one ``forward`` signature and the sampler-facing state.

    ``last_sample_losses``: the detached per-example terms of the last forward, shape (B,), for samplers
    that draw batches by loss (Magnet's neighbourhood sampling, Rippel et al. 2016, Section 3.2); None for
    losses without per-example terms.
    """

    last_sample_losses: Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.last_sample_losses = None

    def forward(self, embeddings: Tensor, labels: Tensor, **batch_info: Tensor) -> Tensor:
        raise NotImplementedError
