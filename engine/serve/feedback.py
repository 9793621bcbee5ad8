"""Judgments on the served index's results (👍/👎): kept, listed and deleted (``index.judgments``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from engine.decode.model_input import RUN_IMAGES, decode_uploads
from engine.serve.item_reader import ItemNotFoundError, find_item
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from foundation.errors import NotFoundError
from index.items import now_utc
from index.judgments import JudgedQuery, Judgment, check_sign

INT64_MAX = 2**63 - 1  # item ids are int64 (SQLite's and Milvus's): a larger number names no item


class JudgmentNotFoundError(NotFoundError):
    code = "judgment_not_found"


def _check_item(bundle: LoadedBundle, item_id: int) -> None:
    if not 0 <= item_id <= INT64_MAX:
        raise ItemNotFoundError(f"no item with id {item_id}")
    find_item(bundle, item_id)


@dataclass(frozen=True)
class Feedback:
    """One judgment as a client gives it: the query by item id (``query_item``) or as the uploaded image's
    bytes (``query_image``), the result's item id and the sign (+1, -1)."""

    result: int
    sign: int
    query_item: int | None = None
    query_image: bytes | None = None


class FeedbackKeeper:
    """Keeps judgments in the served index; writes run alone under the bundle's lock, as item writes do."""

    def __init__(self, current: CurrentBundle, config: ServingConfig) -> None:
        self.current = current
        self.config = config

    def judge(self, feedback: Feedback) -> Judgment:
        """Keep ``feedback``: its items must be in the index (``ItemNotFoundError``); an uploaded query is
        decoded and embedded outside the lock (again under it if a reload swapped in another model), so
        the judgment records the embedding of the model it names."""
        check_sign(feedback.sign)
        bundle = self.current.bundle
        embedding = self._embed(bundle, feedback.query_image)
        with self.current.writing() as served:
            _check_item(served, feedback.result)
            if feedback.query_item is not None:
                _check_item(served, feedback.query_item)
                query = JudgedQuery(item=feedback.query_item)
            else:
                assert feedback.query_image is not None  # the one or the other (Feedback's contract)
                if served.embedder is not bundle.embedder:
                    embedding = self._embed(served, feedback.query_image)
                content_hash = hashlib.sha256(feedback.query_image).hexdigest()
                query = JudgedQuery(content_hash=content_hash, embedding=embedding)
            return served.index.judgments.add(
                query, feedback.result, feedback.sign, served.embedder.fingerprint, now_utc()
            )

    def _embed(self, bundle: LoadedBundle, image: bytes | None) -> np.ndarray | None:
        if image is None:
            return None
        embedder = bundle.embedder
        decoded = self.config.decoder.run(
            decode_uploads, [image], self.config.budget(embedder), embedder.card.preprocessing, images=1
        )
        return embedder.embed_tensor(decoded.tensor, run_size=RUN_IMAGES)[0]

    def remove(self, judgment_id: int) -> Judgment:
        """Delete one judgment and return it; ``JudgmentNotFoundError`` if there is none of that id."""
        with self.current.writing() as served:
            judgment = served.index.judgments.get(judgment_id)
            if judgment is None:
                raise JudgmentNotFoundError(f"no judgment with id {judgment_id}")
            served.index.judgments.remove(judgment_id)
            return judgment

    def page(self, offset: int, limit: int) -> tuple[list[Judgment], int]:
        """A page of judgments in id order, and how many there are."""
        with self.current.reading() as served:
            return served.index.judgments.page(offset, limit), len(served.index.judgments)
