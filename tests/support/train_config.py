"""A training config small enough for a test."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.config import TrainConfig


def tiny_train_config(data: Path, cache: Path, **overrides: object) -> TrainConfig:
    """A training config small enough for a test: contrastive loss, a 16-d embedding and a 32-wide head on
    the cached features in ``cache``; ``overrides`` set any other field."""
    from training.config import TrainConfig  # here: the app and index tests need not load torch

    settings: dict[str, object] = {"loss": "contrastive", "embedding_dim": 16, "head_hidden": 32, **overrides}
    return TrainConfig(data=str(data), cache_dir=str(cache), **settings)
