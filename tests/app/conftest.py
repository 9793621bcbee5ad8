"""Fixtures for the API tests: writable copies of the demo index, in-process apps and real uvicorn servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support.apps import app_clients
from tests.support.served import Served, copy_served


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
    defaults = {
        "index_path": served.index,
        "model_path": served.model,
        "threads": 1,
        "rate_limit_per_second": 0,
    }
    with app_clients(defaults) as make:
        yield make
