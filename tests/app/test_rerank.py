"""rerank=pddm through the API: a model card naming a PDDM unit, ordering by a torch re-scoring, paging."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from engine.decode.images import decode_image
from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from engine.model.reranker import PDDMReranker
from engine.serve.loaded_bundle import LoadedBundle
from engine.serve.query import SearchOptions
from engine.serve.search import SearchService
from index.connection import MilvusConnection
from index.gallery import GalleryIndex
from index.protocol import Entry, normalize_rows
from tests.support.served import Served
from training.export import export_pddm_unit, pddm_path_for
from training.losses.pddm import PDDMUnit

COFFEE = "coffee/01_crop.jpg"
CAT = "cat/00_crop.jpg"
POOL = 12  # rerank_pool of the test server; with k = 3 the pool is max(12, 4 x 3) = 12 candidates


@dataclass(frozen=True)
class PDDMModel:
    path: Path
    unit: PDDMUnit


@pytest.fixture(scope="module")
def pddm_model(exported_model: Path, tmp_path_factory: pytest.TempPathFactory) -> PDDMModel:
    """The session's model plus a fixed random PDDM unit exported beside it and named in its card.

    The embedding graph (and so its fingerprint and the demo index) is unchanged: only the card gains
    the reranker, as ``dmlsearch export`` writes it for a pddm run.
    """
    path = tmp_path_factory.mktemp("pddm_model") / "model.onnx"
    shutil.copy(exported_model, path)
    card = ModelCard.load(exported_model)
    torch.manual_seed(0)
    unit = PDDMUnit(card.embedding_dim, hidden=32).eval()
    reranker = export_pddm_unit(unit, pddm_path_for(path))
    card.model_copy(update={"loss": "pddm", "reranker": reranker}).save(path)
    return PDDMModel(path, unit)


@pytest.fixture
def client(make_client: Callable[..., TestClient], pddm_model: PDDMModel) -> TestClient:
    return make_client(model_path=pddm_model.path, rerank_pool=POOL)


def _query_vector(model: Path, data: bytes) -> np.ndarray:
    """The query's embedding, decoded as the server decodes it (JPEG draft at the model's resize size)."""
    embedder = Embedder(model, threads=1)
    image = decode_image(data, draft_size=embedder.card.preprocessing.resize_size)
    return embedder.embed([image])[0]


def _reference(served: Served, unit: PDDMUnit, query: np.ndarray, ids: list[int]) -> tuple[list[int], dict]:
    """Candidates ``ids`` ordered by the torch unit on their stored vectors; and their cosines and scores."""
    index = GalleryIndex.open(served.index)
    try:
        stored = index.items.vectors(np.array(ids))
    finally:
        index.close()
    with torch.inference_mode():
        scores = unit.score(torch.from_numpy(query[None]), torch.from_numpy(stored)).numpy()[0]
    order = [ids[i] for i in np.argsort(-scores, kind="stable")]
    return order, {item_id: (float(stored[i] @ query), float(scores[i])) for i, item_id in enumerate(ids)}


def _search(client: TestClient, data: bytes, **params: object) -> list[dict]:
    response = client.post("/v1/search", params=params, files={"image": ("q.jpg", data)})
    assert response.status_code == 200, response.text
    return response.json()["results"]


def test_rerank_orders_the_pool_by_the_pddm_unit(
    client: TestClient, served: Served, pddm_model: PDDMModel
) -> None:
    assert client.get("/v1/stats").json()["rerankers"] == ["pddm"]
    data = (served.gallery / COFFEE).read_bytes()
    cosine = _search(client, data, k=POOL)
    expected, scores = _reference(
        served, pddm_model.unit, _query_vector(pddm_model.path, data), [r["id"] for r in cosine]
    )

    response = client.post("/v1/search", params={"k": 3, "rerank": "pddm"}, files={"image": ("q.jpg", data)})
    assert response.status_code == 200, response.text
    assert "rerank" in response.json()["timings_ms"]
    pages = [_search(client, data, k=3, offset=offset, rerank="pddm") for offset in range(0, POOL + 3, 3)]
    assert pages[-1] == []  # pages end with the pool
    reranked = [result for page in pages for result in page]
    assert [r["id"] for r in reranked] == expected
    assert [r["rank"] for r in reranked] == list(range(1, POOL + 1))
    assert [r["id"] for r in reranked] != [r["id"] for r in cosine]  # the unit did re-order
    for result in reranked:
        cosine_score, pddm_score = scores[result["id"]]
        assert result["score"] == pytest.approx(cosine_score, abs=1e-5)
        assert result["pddm_score"] == pytest.approx(pddm_score, abs=1e-5)
    assert all(r["pddm_score"] is None for r in cosine)


def test_min_score_cuts_on_the_cosine_before_reranking(
    client: TestClient, served: Served, pddm_model: PDDMModel
) -> None:
    data = (served.gallery / COFFEE).read_bytes()
    cosine = _search(client, data, k=POOL)
    threshold = (cosine[5]["score"] + cosine[6]["score"]) / 2  # keeps the six best by cosine
    expected, _ = _reference(
        served, pddm_model.unit, _query_vector(pddm_model.path, data), [r["id"] for r in cosine[:6]]
    )
    results = [
        result
        for offset in (0, 3, 6)
        for result in _search(client, data, k=3, offset=offset, min_score=threshold, rerank="pddm")
    ]
    assert [r["id"] for r in results] == expected
    assert [r["rank"] for r in results] == [1, 2, 3, 4, 5, 6]


def test_similar_and_batch_rerank_like_single_searches(
    client: TestClient, served: Served, pddm_model: PDDMModel
) -> None:
    coffee, cat = (served.gallery / COFFEE).read_bytes(), (served.gallery / CAT).read_bytes()
    cosine = _search(client, coffee, k=POOL + 1)
    item_id = cosine[0]["id"]
    assert cosine[0]["path"] == COFFEE
    expected, _ = _reference(
        served, pddm_model.unit, _query_vector(pddm_model.path, coffee), [r["id"] for r in cosine[1:]]
    )
    similar = client.get(f"/v1/items/{item_id}/similar", params={"k": 3, "rerank": "pddm"})
    assert similar.status_code == 200, similar.text
    assert [r["id"] for r in similar.json()["results"]] == expected[:3]

    batch = client.post(
        "/v1/search/batch",
        params={"k": 3, "rerank": "pddm"},
        files=[("images", ("a.jpg", coffee)), ("images", ("b.jpg", cat))],
    )
    assert batch.status_code == 200, batch.text
    for data, query in zip((coffee, cat), batch.json()["queries"], strict=True):
        single = _search(client, data, k=3, rerank="pddm")
        assert [r["id"] for r in query["results"]] == [r["id"] for r in single]
        assert [r["pddm_score"] for r in query["results"]] == pytest.approx(
            [r["pddm_score"] for r in single], abs=1e-5
        )


def test_a_changed_unit_file_keeps_the_server_not_ready(
    make_client: Callable[..., TestClient], pddm_model: PDDMModel, tmp_path: Path
) -> None:
    model = tmp_path / "model.onnx"
    for source in (pddm_model.path, ModelCard.path_for(pddm_model.path), pddm_path_for(pddm_model.path)):
        shutil.copy(source, tmp_path / source.name)
    unit_path = pddm_path_for(model)
    unit_path.write_bytes(unit_path.read_bytes() + b"\0")
    ready = make_client(model_path=model).get("/readyz")
    assert ready.status_code == 503
    assert "model.pddm.onnx does not match its model.json" in ready.json()["error"]["message"]


def test_a_milvus_index_reranks_from_its_stored_vectors(
    pddm_model: PDDMModel, served: Served, tmp_path: Path
) -> None:
    pytest.importorskip(
        "milvus_lite", reason="Milvus Lite is not installed (pip install 'dmlsearch[milvus]')"
    )
    card = ModelCard.load(pddm_model.path)
    index = GalleryIndex.create(
        tmp_path / "milvus_index",
        dim=card.embedding_dim,
        model_fingerprint=card.fingerprint,
        gallery_root=None,
        backend="milvus",
        milvus=MilvusConnection(str(tmp_path / "milvus_index" / "milvus.db")),
    )
    try:
        vectors = np.random.default_rng(0).normal(size=(6, card.embedding_dim)).astype(np.float32)
        ids = index.add(vectors, [Entry(f"{i}.jpg", None, f"{i:064x}") for i in range(6)])
        stored = index.vectors(ids[::-1])  # Milvus gives back the vectors it stores, in the order asked
        np.testing.assert_allclose(stored, normalize_rows(vectors)[::-1], rtol=0, atol=1e-6)
        reranker = PDDMReranker.for_model(pddm_model.path, card, threads=1)
        service = SearchService(LoadedBundle(Embedder(pddm_model.path, threads=1), index, reranker))
        assert service.rerankers == ["pddm"]
        data = (served.gallery / CAT).read_bytes()
        (hits,) = service.queries.search([data], SearchOptions(k=6, rerank="pddm")).queries
        query = _query_vector(pddm_model.path, data)
        with torch.inference_mode():
            scores = pddm_model.unit.score(
                torch.from_numpy(query[None]), torch.from_numpy(normalize_rows(vectors))
            ).numpy()[0]
        assert [r.id for r in hits.results] == [ids[i] for i in np.argsort(-scores, kind="stable")]
        by_id = dict(zip(ids, scores.tolist(), strict=True))
        assert [r.pddm_score for r in hits.results] == pytest.approx(
            [by_id[r.id] for r in hits.results], abs=1e-5
        )
        (plain,) = service.queries.search([data], SearchOptions(k=2)).queries
        assert len(plain.results) == 2 and all(r.pddm_score is None for r in plain.results)
    finally:
        index.close()
