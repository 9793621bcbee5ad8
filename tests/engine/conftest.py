"""Fixtures for the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.embedder import Embedder


@pytest.fixture(scope="module")
def embedder(exported_model: Path) -> Embedder:
    """The session's exported pretrained model on one thread."""
    return Embedder(exported_model, threads=1)
