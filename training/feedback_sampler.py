"""Batches that hold judged pairs (issue 40): the loss's own batch, plus the judgments of a few queries.

:class:`FeedbackSampler` wraps the sampler a run would use without judgments (the loss's layout over a
labelled folder's classes, or over a label-free run's pseudo-labels; none for a run on judgments alone) and
appends to each of its batches the judged photos of :data:`JUDGED_QUERIES` training queries, drawn at
random, as consecutive pairs: for each 👍 the query and the result, for each 👎 the result twice (two views
of one photo: a certain positive pair), and the query twice where it has no 👍. So every batch keeps the
layout LoOp needs (consecutive positive pairs), and the loss gets ``batch_info[PAIR_SIGNS]``
(:meth:`training.feedback_data.Closure.signs`), with which a judgment outweighs the labels
(:func:`training.losses.pairs.pair_masks`). Judged photos that are not in the folder are rows of their
own, :data:`~training.losses.pairs.UNLABELLED`; a judged photo that is also a training photo of the folder
keeps its row and its (pseudo-)label where it is not judged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from training.feedback_data import Closure, JudgedPair
from training.losses.base import MetricLoss
from training.losses.pairs import PAIR_SIGNS, UNLABELLED
from training.samplers import ClassBalancedSampler

# Judged queries a batch holds: with the simulated user's 10 judgments a query, about 6 x 20 = 120 rows,
# as many as the layouts' own batches (128). Not cross-validated.
JUDGED_QUERIES = 6


class FeedbackSampler(ClassBalancedSampler):
    """The ``inner`` sampler's batches (over the first ``len(inner.labels)`` training rows) plus judged
    pairs; see the module docstring. ``row_items``: the item each training row shows, -1 for none."""

    def __init__(
        self,
        inner: ClassBalancedSampler | None,
        row_items: np.ndarray,
        pairs: tuple[JudgedPair, ...],
        *,
        queries: int = JUDGED_QUERIES,
        seed: int = 0,
    ) -> None:
        self.inner = inner
        self.row_items = np.asarray(row_items, dtype=np.int64)
        rows: dict[int, int] = {}
        for row, item in enumerate(self.row_items.tolist()):
            if item >= 0:
                rows.setdefault(item, row)
        self.closure = Closure(pairs)
        groups: dict[int, list[int]] = {}  # query row -> its batch rows, in pairs
        liked: set[int] = set()
        for pair in pairs:
            query, result = rows[pair.query], rows[pair.result]
            groups.setdefault(query, []).extend([query, result] if pair.sign > 0 else [result, result])
            if pair.sign > 0:
                liked.add(query)
        for query, units in groups.items():
            if query not in liked:
                units.extend([query, query])
        self.groups = [np.array(units, dtype=np.int64) for units in groups.values()]
        self.queries = min(queries, len(self.groups))
        self.rng = np.random.default_rng(seed)
        self.inner_size = 0  # rows of the last batch that the inner sampler drew

    @property
    def labels(self) -> np.ndarray:  # type: ignore[override]
        """What the loss sees per training row: the inner sampler's (pseudo-)labels, UNLABELLED past them."""
        inner = self.inner.labels if self.inner is not None else np.zeros(0, dtype=np.int64)
        padding = np.full(len(self.row_items) - len(inner), UNLABELLED, dtype=np.int64)
        return np.concatenate([np.asarray(inner, dtype=np.int64), padding])

    @property
    def batch_size(self) -> int:
        inner = self.inner.batch_size if self.inner is not None else 0
        judged = sum(len(group) for group in self.groups) * self.queries // max(1, len(self.groups))
        return inner + judged

    def next_indices(self) -> np.ndarray:
        inner = self.inner.next_indices() if self.inner is not None else np.zeros(0, dtype=np.int64)
        self.inner_size = len(inner)
        chosen = self.rng.choice(len(self.groups), size=self.queries, replace=False)
        return np.concatenate([inner, *(self.groups[g] for g in chosen)])

    def batch_info(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        info = self.inner.batch_info(indices[: self.inner_size]) if self.inner is not None else {}
        return {**info, PAIR_SIGNS: torch.from_numpy(self.closure.signs(self.row_items[indices]))}

    def after_step(self, indices: np.ndarray, loss: MetricLoss) -> None:
        if self.inner is not None:
            self.inner.after_step(indices[: self.inner_size], loss)

    def refresh_due(self, step: int) -> bool:
        return self.inner is not None and self.inner.refresh_due(step)

    def refresh(self, embeddings: np.ndarray) -> None:
        if self.inner is not None:
            self.inner.refresh(embeddings)

    def state_dict(self) -> dict[str, Any]:
        inner = self.inner.state_dict() if self.inner is not None else {}
        return {"rng": self.rng.bit_generator.state, "inner": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])
