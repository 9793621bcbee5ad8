"""The explainer graph exported beside an explainable model, run through onnxruntime (``engine.serve.explain``
uses it to split a similarity over image positions)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from engine.model.embedder import ModelSession
from engine.model.model_card import EXPLAINER_OUTPUTS, MAPS_OUTPUT, ModelCard, check_fingerprint

log = logging.getLogger(__name__)


class Explainer:
    """The exported explainer graph: feature maps in, each position's share of the embedding out."""

    def __init__(self, path: Path, *, threads: int = 0, device: str = "auto") -> None:
        self.session = ModelSession(path, threads=threads, device=device)

    @classmethod
    def for_model(
        cls, model_path: Path, card: ModelCard, *, threads: int = 0, device: str = "auto"
    ) -> Explainer | None:
        """The explainer the model's card names (checked against its fingerprint), or None.

        A missing file (a model copied without it) leaves the model served without explanations: search
        does not need it, and ``/v1/explain`` then says which file to copy.
        """
        if card.explainer is None:
            return None
        path = card.explainer.path_beside(model_path)
        if not path.is_file():
            log.warning("%s names its explainer %s, which is missing: no explanations", model_path, path)
            return None
        check_fingerprint(path, card.explainer.fingerprint, model_path)
        return cls(path, threads=threads, device=device)

    def split(self, maps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(contributions (n, h, w, d), rest (n, d))`` of feature maps (n, c, h, w)."""
        contributions, rest = self.session.run(list(EXPLAINER_OUTPUTS), {MAPS_OUTPUT: maps})
        return contributions, rest
