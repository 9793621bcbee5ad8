"""A missing or mismatched model or index at start: serve exits 2 saying why, unless asked to wait for the
index (then the process stays up, /readyz says why, search is 503, until the index is there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.api import create_app
from app.settings import Settings
from bench.lib.images import image_bytes, make_image
from bench.lib.servers import free_port
from engine.model.model_card import ModelCard
from foundation.errors import DmlsearchError
from tests.support.served import Served
from tests.support.servers import uvicorn_server
from tests.support.waiting import wait_until


def not_ready_client(model: Path, index: Path) -> TestClient:
    settings = Settings(model_path=model, index_path=index, rate_limit_per_second=0, wait_for_index=True)
    return TestClient(create_app(settings), raise_server_exceptions=False)


def assert_not_ready(client: TestClient, reason: str) -> None:
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["error"]["code"] == "not_ready"
    assert reason in ready.json()["error"]["message"]
    search = client.post("/v1/search", files={"image": ("q.png", image_bytes(make_image(1)))})
    assert search.status_code == 503
    assert reason in search.json()["error"]["message"]
    for path in ("/v1/stats", "/v1/items/1", "/v1/items/1/similar"):
        assert client.get(path).status_code == 503
    assert "dmlsearch_index_items -1.0" in client.get("/metrics").text


def test_missing_index(served: Served, tmp_path: Path) -> None:
    with not_ready_client(served.model, tmp_path / "nowhere") as client:
        assert_not_ready(client, "no manifest.json")


def test_missing_model(served: Served, tmp_path: Path) -> None:
    with not_ready_client(tmp_path / "missing.onnx", served.index) as client:
        assert_not_ready(client, "does not exist")


def test_model_without_its_card(served: Served, tmp_path: Path) -> None:
    lonely = tmp_path / "model.onnx"
    shutil.copy(served.model, lonely)
    with not_ready_client(lonely, served.index) as client:
        assert_not_ready(client, "model.json")


def test_index_built_with_another_model(served: Served) -> None:
    manifest = json.loads((served.index / "manifest.json").read_text())
    manifest["model_fingerprint"] = "f" * 64
    (served.index / "manifest.json").write_text(json.dumps(manifest))
    with not_ready_client(served.model, served.index) as client:
        assert_not_ready(client, "rebuild the index with this model")


def test_model_whose_bytes_do_not_match_its_card(served: Served, tmp_path: Path) -> None:
    tampered = tmp_path / "model.onnx"
    tampered.write_bytes(served.model.read_bytes() + b"\0")
    ModelCard.load(served.model).save(tampered)
    with not_ready_client(tampered, served.index) as client:
        assert_not_ready(client, "does not match its model.json")


@pytest.mark.server
def test_serve_with_no_index_exits_2_saying_why(served: Served, tmp_path: Path) -> None:
    """A typo in the index path is an error at once, not a server that answers 503 for ever."""
    typo = tmp_path / "typo"
    command = [sys.executable, "-m", "cli.main", "serve", "--port", str(free_port())]
    run = subprocess.run([*command, "--index", str(typo)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith(f"error: {typo} is not an index directory (no manifest.json); "), run.stderr
    assert "--wait-for-index" in run.stderr and "Traceback" not in run.stderr
    # Its model missing, through the environment as a container sets it: the same.
    env = {**os.environ, "DMLSEARCH_INDEX_PATH": str(served.index), "DMLSEARCH_MODEL_PATH": str(typo)}
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2 and run.stderr.startswith(f"error: model file {typo} does not exist"), (
        run.stderr
    )
    with pytest.raises(DmlsearchError, match="not an index directory"):  # any host of the app, not only serve
        create_app(Settings(index_path=typo))


@pytest.mark.server
def test_a_server_waiting_for_its_index_serves_it_once_it_is_there(served: Served, tmp_path: Path) -> None:
    later = tmp_path / "later"
    args = ["--index", str(later), "--wait-for-index", "--index-poll-seconds", "0.2"]
    query = {"image": ("q.png", image_bytes(make_image(1)))}
    with uvicorn_server(args, ready_path="/healthz") as url:
        ready = httpx.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 503
        assert f"{later} is not an index directory (no manifest.json)" in ready.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/search", files=query, timeout=10).status_code == 503
        shutil.copytree(served.index, later)  # the replica's index arrives (it carries its model)
        wait_until(lambda: httpx.get(f"{url}/readyz", timeout=10).status_code == 200, 60, "the index loaded")
        search = httpx.post(f"{url}/v1/search", files=query, timeout=60)
        assert search.status_code == 200 and search.json()["results"], search.text


def test_invalid_serve_settings_are_cli_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    assert runner.invoke(app, ["serve", "--max-k", "0"]).exit_code == 2  # refused by the flag's range
    monkeypatch.setenv("DMLSEARCH_MAX_UPLOAD_BYTES", "-5")  # refused by the settings model
    result = runner.invoke(app, ["serve"])
    assert result.exit_code == 2
    assert "max_upload_bytes" in result.output


def test_index_of_another_backend_than_configured(served: Served) -> None:
    settings = Settings(model_path=served.model, index_path=served.index, backend="milvus")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert_not_ready(client, "is a faiss index, not milvus")
