"""A server that answers but does not list the index's collections yet (issue 42): under load, a
restarted Milvus 2.3.5 answered its version while a collection it held was "not found"
(tests/index/test_milvus_restart.py in a full run). No server does that on demand, so pymilvus's
``has_collection`` is made to answer False for a while, on Milvus Lite: opening the index waits for the
listing and never creates a collection over one the server has not listed; reads after a reconnection never
take "not listed" for "nothing removed"."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from index import milvus_backend
from index.gallery import GalleryIndex
from index.protocol import BackendUnavailableError
from tests.support.vectors import clustered_vectors, entries

DIM = 8
COUNT = 6
UNLISTED_S = 1.5  # how long the server "does not list" the collections


def _built(tmp_path: Path) -> Path:
    pytest.importorskip("milvus_lite")
    directory = tmp_path / "index"
    with closing(
        GalleryIndex.create(directory, dim=DIM, model_fingerprint="m", gallery_root=None, backend="milvus")
    ) as index:
        index.add(clustered_vectors(COUNT, DIM), entries(COUNT))
        index.save()
    return directory


def _unlisted(monkeypatch: pytest.MonkeyPatch, until: Callable[[], bool]) -> list[str]:
    """pymilvus's ``has_collection`` answers False until ``until()``; returns the names of the collections
    created meanwhile, as they are asked for."""
    from pymilvus import MilvusClient

    listed, create = MilvusClient.has_collection, MilvusClient.create_collection
    created: list[str] = []

    def has_collection(self: MilvusClient, name: str, **kwargs: object) -> bool:
        return until() and listed(self, name, **kwargs)

    def create_collection(self: MilvusClient, name: str, *args: object, **kwargs: object) -> None:
        created.append(name)
        create(self, name, *args, **kwargs)

    monkeypatch.setattr(MilvusClient, "has_collection", has_collection)
    monkeypatch.setattr(MilvusClient, "create_collection", create_collection)
    return created


def test_an_index_opened_before_the_server_lists_its_collection_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _built(tmp_path)
    listed_at = time.monotonic() + UNLISTED_S
    created = _unlisted(monkeypatch, lambda: time.monotonic() >= listed_at)
    with closing(GalleryIndex.open(directory)) as index:
        assert time.monotonic() >= listed_at
        assert len(index) == COUNT
    assert created == [], "a collection was created over the index's own"


def test_an_index_whose_collection_is_never_listed_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _built(tmp_path)
    monkeypatch.setattr(milvus_backend, "OPEN_WAIT_S", UNLISTED_S)
    created = _unlisted(monkeypatch, lambda: False)
    with pytest.raises(
        BackendUnavailableError, match="does not list the collection 'dmlsearch' of this index"
    ):
        GalleryIndex.open(directory)
    assert created == []


def test_a_reconnection_while_the_collections_are_not_listed_answers_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not "no removed ids": a replica that read none would serve the rows the server brought back."""
    directory = _built(tmp_path)
    with closing(GalleryIndex.open(directory)) as index:
        listing = [False]
        _unlisted(monkeypatch, lambda: listing[0])
        index.items.client._drop(None)  # the next call connects afresh, as after a restart
        with pytest.raises(BackendUnavailableError, match="does not list the collections of this index"):
            len(index)
        listing[0] = True
        assert len(index) == COUNT
