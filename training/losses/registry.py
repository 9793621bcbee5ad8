"""Registry of every loss by name, with the paper defaults and the batch layout it needs.

A loss is a :class:`~training.losses.base.MetricLoss`, called as ``loss(embeddings, labels, **batch_info)
-> scalar``. Each loss module registers itself with :func:`register_loss`; :func:`build_loss` constructs
one by name, so the trainer and the CLI never import loss classes directly.

The paper defaults are written once, in the loss's constructor: a spec's :attr:`LossSpec.defaults` are
read from the factory's signature (as timm keeps a model's defaults with its code), so a registration
only adds what the constructor cannot say: the batch layout, the paper, a summary, and ``fixed``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from foundation.errors import InvalidInputError
from training.losses.base import MetricLoss
from training.registry import Registry

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


def signature_defaults(factory: Callable[..., Any], exclude: set[str]) -> dict[str, Any]:
    """The keyword defaults of ``factory``'s signature, minus ``exclude``; every argument needs one."""
    defaults: dict[str, Any] = {}
    for parameter in inspect.signature(factory).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.name in exclude:
            continue
        if parameter.default is parameter.empty:
            raise TypeError(f"{factory!r}: argument {parameter.name!r} has no default to register")
        defaults[parameter.name] = parameter.default
    return defaults


@dataclass(frozen=True)
class LossSpec:
    """A registered loss. ``fixed`` are constructor arguments that define this entry (e.g. which base
    loss a LoOp loss wraps) and cannot be overridden through :func:`build_loss`."""

    name: str
    factory: Callable[..., MetricLoss]
    defaults: dict[str, Any]  # the tunable hyperparameters with their paper values, from the constructor
    layout: BatchLayout
    paper: str
    summary: str
    fixed: dict[str, Any] = field(default_factory=dict)
    # Why the loss can be 0 at every step, in a user's words: what a run that learned nothing is told.
    when_zero: str = ""
    # Whether the loss reads its pairs through training.losses.pairs.pair_masks, so that judged pairs
    # (batch_info's pair_signs) train it: what `dmlsearch train --feedback` needs of a loss (issue 40).
    judged_pairs: bool = False

    def build(self, **hparams: Any) -> MetricLoss:
        unknown = set(hparams) - set(self.defaults)
        if unknown:
            raise InvalidInputError(
                f"loss {self.name!r} has no hyperparameter(s) {sorted(unknown)}; "
                f"known: {sorted(self.defaults)}"
            )
        return self.factory(**{**self.defaults, **hparams, **self.fixed})


LOSSES: Registry[LossSpec] = Registry("loss")


def register_loss(
    name: str,
    factory: Callable[..., MetricLoss],
    *,
    layout: BatchLayout,
    paper: str,
    summary: str,
    fixed: dict[str, Any] | None = None,
    when_zero: str = "",
    judged_pairs: bool = False,
) -> LossSpec:
    """Add a loss to the registry; its defaults are its constructor's (see the module docstring)."""
    fixed = dict(fixed or {})
    defaults = signature_defaults(factory, exclude=set(fixed))
    spec = LossSpec(name, factory, defaults, layout, paper, summary, fixed, when_zero, judged_pairs)
    return LOSSES.add(name, spec)


def build_loss(name: str, **hparams: Any) -> MetricLoss:
    """Construct the loss registered as ``name`` with the paper defaults overridden by ``hparams``."""
    return LOSSES[name].build(**hparams)
