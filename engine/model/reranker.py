"""Re-score search candidates with the PDDM unit exported beside a model, through onnxruntime.

Huang, Loy, Tang, "Local Similarity-Aware Deep Feature Embedding" (NIPS 2016) retrieve by the learned
"PDDM score" S(query, candidate) instead of the feature distance. Here the index finds the candidates by
cosine similarity and the unit re-orders them: scoring every gallery item with the unit would cost a small
network evaluation per item and query.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.model.embedder import ModelSession
from engine.model.model_card import RERANKER_INPUTS, ModelCard, check_fingerprint
from foundation.errors import NotFoundError


class PDDMReranker:
    """The exported PDDM unit: a query embedding and its candidates' embeddings in, S(q, c) out."""

    def __init__(self, path: Path, *, threads: int = 0, device: str = "auto") -> None:
        self.session = ModelSession(path, threads=threads, device=device)

    @classmethod
    def for_model(
        cls, model_path: Path, card: ModelCard, *, threads: int = 0, device: str = "auto"
    ) -> PDDMReranker | None:
        """The PDDM unit the model's card names (checked against its fingerprint), or None."""
        if card.reranker is None:
            return None
        path = card.reranker.path_beside(model_path)
        if not path.is_file():
            raise NotFoundError(f"{ModelCard.path_for(model_path)} names {path}, which does not exist")
        check_fingerprint(path, card.reranker.fingerprint, model_path)
        return cls(path, threads=threads, device=device)

    def score(self, query: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """S(query, candidate) for one query (d,) and its candidates (k, d): a float32 (k,) array."""
        if len(candidates) == 0:
            return np.zeros(0, dtype=np.float32)
        queries_name, candidates_name = RERANKER_INPUTS
        (scores,) = self.session.run(
            None,
            {
                queries_name: np.ascontiguousarray(query[None], dtype=np.float32),
                candidates_name: np.ascontiguousarray(candidates[None], dtype=np.float32),
            },
        )
        return scores[0]
