"""Deep-metric-learning losses: the five papers' methods and the baselines they compare against.

Importing this package registers every loss; use :func:`build_loss` to make one by name.
"""

from training.losses import almn, angular, baselines, loop, magnet, npair, pddm  # noqa: F401  (registration)
from training.losses.registry import LOSSES, BatchLayout, LossSpec, build_loss, register_loss

__all__ = ["LOSSES", "BatchLayout", "LossSpec", "build_loss", "register_loss"]
