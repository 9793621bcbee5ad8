"""Deep-metric-learning losses: the five papers' methods and the baselines they compare against.

Importing this package registers every loss; use :func:`build_loss` to make one by name. Every loss is a
:class:`MetricLoss`, called as ``loss(embeddings, labels, **batch_info)``.
"""

from training.losses import almn, angular, baselines, loop, magnet, npair, pddm  # noqa: F401  (registration)
from training.losses.base import MetricLoss
from training.losses.registry import LOSSES, BatchLayout, LossSpec, build_loss, register_loss

__all__ = ["LOSSES", "BatchLayout", "LossSpec", "MetricLoss", "build_loss", "register_loss"]
