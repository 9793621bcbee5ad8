"""Every model run in the server has a deadline (``embed_run_seconds``): onnxruntime is told to stop a run
that overruns it, the request gets 503 ``embed_timeout`` (the server's state, not the request's), and the
run's thread and compute slot are free again at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.context import AppContext
from bench.lib.images import image_bytes, make_image
from engine.model.bundle import STORED_MODEL
from engine.model.embedder import Embedder, EmbedTimeoutError
from tests.hostile_bundles import with_hostile_model
from tests.support.served import Served


def test_a_search_over_its_embedding_deadline_is_503_and_frees_its_slot(
    make_client: Callable[..., TestClient],
) -> None:
    # Before: no deadline on embedding at all (only decoding had one). A deadline no real run can meet,
    # set once the server is up (the start-up probe runs under the same deadline and would not pass).
    client = make_client()
    context = AppContext.of(client.app)
    context.engine.service.current.bundle.embedder.run_seconds = 1e-6
    query = {"image": ("q.png", image_bytes(make_image(5, (64, 48)), "PNG"))}
    for _ in range(3):  # more than the compute slots: each answer gave its slot back
        response = client.post("/v1/search", files=query)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "embed_timeout"
        assert response.headers["Retry-After"]
    assert context.compute.in_use == 0
    assert client.get("/healthz").status_code == 200


def test_a_model_that_never_ends_is_stopped_at_its_deadline(served: Served, tmp_path: Path) -> None:
    """The endless model (a Loop of 2^62 steps) run in this process: before, the run held its thread and
    a core for good; now onnxruntime stops it at its deadline."""
    bundle = with_hostile_model(served.index, tmp_path / "endless", "endless")
    embedder = Embedder(bundle / STORED_MODEL, threads=1, run_seconds=1.0)
    started = time.perf_counter()
    with pytest.raises(EmbedTimeoutError, match="within 1 s"):
        embedder.embed([make_image(6, (64, 48))])
    assert time.perf_counter() - started < 10
