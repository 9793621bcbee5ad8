"""Fixtures for the API tests: writable copies of the demo index, in-process apps and real uvicorn servers."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.api import create_app
from app.settings import Settings
from index.manifest import Manifest
from tests.conftest import free_port

API_KEY = "test-key-0123456789"
INDEX_FILES = ("manifest.json", "vectors.faiss", "items.sqlite")


@dataclass(frozen=True)
class Served:
    """A writable copy of the demo gallery and its index (so tests may add, delete and tamper)."""

    gallery: Path
    index: Path
    model: Path


def copy_served(demo_gallery: Path, demo_index: Path, exported_model: Path, target: Path) -> Served:
    gallery = target / "gallery"
    index = target / "index"
    shutil.copytree(demo_gallery, gallery)
    shutil.copytree(demo_index, index)
    manifest = Manifest.load(index)
    manifest.gallery_root = str(gallery.resolve())
    manifest.save(index)
    return Served(gallery, index, exported_model)


def index_digest(index: Path) -> dict[str, str]:
    """Content hashes of the index files, to show that a request changed nothing."""
    return {name: hashlib.sha256((index / name).read_bytes()).hexdigest() for name in INDEX_FILES}


@pytest.fixture
def served(tmp_path: Path, demo_gallery: Path, demo_index: Path, exported_model: Path) -> Served:
    return copy_served(demo_gallery, demo_index, exported_model, tmp_path)


@pytest.fixture(scope="module")
def served_module(
    tmp_path_factory: pytest.TempPathFactory, demo_gallery: Path, demo_index: Path, exported_model: Path
) -> Served:
    return copy_served(demo_gallery, demo_index, exported_model, tmp_path_factory.mktemp("served"))


@pytest.fixture
def make_client(served: Served) -> Iterator[Callable[..., TestClient]]:
    """Build an in-process app over the test's copy of the index: ``make_client(api_key=..., ...)``."""
    clients: list[TestClient] = []

    def make(**overrides: object) -> TestClient:
        defaults = {
            "index_path": served.index,
            "model_path": served.model,
            "threads": 1,
            "rate_limit_per_second": 0,
        }
        settings = Settings(**{**defaults, **overrides})
        client = TestClient(create_app(settings), raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@contextmanager
def uvicorn_server(
    args: list[str], env: dict[str, str] | None = None, ready_path: str = "/readyz"
) -> Iterator[str]:
    """``dmlsearch serve ARGS`` in a real uvicorn process on a free port; yields its base URL.

    Waits until ``ready_path`` answers 200 (``/healthz`` for servers that are meant not to be ready).
    """
    port = free_port()
    command = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--threads", "1", *args]
    process = subprocess.Popen(command, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, f"server exited with code {process.returncode}"
            try:
                if httpx.get(f"{base}{ready_path}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{base}{ready_path} never answered 200"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=20)
