"""Registry of every loss by name, with the paper defaults and the batch layout it needs.

A loss is any ``nn.Module`` called as ``loss(embeddings, labels, **batch_info) -> scalar``.
Each loss module registers itself with :func:`register_loss`; :func:`build_loss` constructs one
by name, so the trainer and the CLI never import loss classes directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

LayoutKind = Literal["classes_x_samples", "clusters_x_examples"]


@dataclass(frozen=True)
class BatchLayout:
    """How a mini-batch must be drawn for a loss to see what it needs.

    ``classes_x_samples``: ``classes`` distinct labels with ``samples_per_class`` examples each,
    laid out consecutively (so consecutive pairs share a label when ``samples_per_class`` is even).
    ``clusters_x_examples``: Magnet's neighbourhood batches, ``classes`` = M clusters of
    ``samples_per_class`` = D examples, with per-sample ``cluster_ids`` passed to the loss.
    """

    kind: LayoutKind
    classes: int
    samples_per_class: int
    description: str

    @property
    def batch_size(self) -> int:
        return self.classes * self.samples_per_class


@dataclass(frozen=True)
class LossSpec:
    name: str
    factory: Callable[..., nn.Module]
    defaults: dict[str, Any]
    layout: BatchLayout
    paper: str
    summary: str
    fixed: dict[str, Any] = field(default_factory=dict)

    def build(self, **hparams: Any) -> nn.Module:
        unknown = set(hparams) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"loss {self.name!r} has no hyperparameter(s) {sorted(unknown)}; "
                f"known: {sorted(self.defaults)}"
            )
        return self.factory(**{**self.defaults, **hparams, **self.fixed})


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    factory: Callable[..., nn.Module],
    *,
    layout: BatchLayout,
    paper: str,
    summary: str,
    defaults: dict[str, Any] | None = None,
    fixed: dict[str, Any] | None = None,
) -> None:
    """Add a loss to the registry.

    ``defaults`` are the tunable hyperparameters with the paper's values; ``fixed`` are constructor
    arguments that define this registry entry (e.g. which base loss a LoOp loss wraps) and cannot be
    overridden through :func:`build_loss`.
    """
    if name in LOSSES:
        raise ValueError(f"loss {name!r} registered twice")
    LOSSES[name] = LossSpec(name, factory, dict(defaults or {}), layout, paper, summary, dict(fixed or {}))


def build_loss(name: str, **hparams: Any) -> nn.Module:
    """Construct the loss registered as ``name`` with the paper defaults overridden by ``hparams``."""
    try:
        spec = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}") from None
    return spec.build(**hparams)
