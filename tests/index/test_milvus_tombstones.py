"""Removed ids after a new connection (``index.milvus_tombstones``), on Milvus Lite: reads leave them out
at once, while the server may still hold them, and the background re-deletion removes them from the server
(tests/index/test_milvus_restart.py does the same across a restart of the real server)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from index.gallery import GalleryIndex
from index.judgments import JudgedQuery
from index.milvus_tombstones import MilvusTombstones
from tests.support.vectors import clustered_vectors, entries
from tests.support.waiting import wait_until

DIM = 8
COUNT = 12
TIME = "2026-01-02T03:04:05+00:00"


def test_removed_rows_the_server_brought_back_are_left_out_until_deleted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("milvus_lite")
    vectors = clustered_vectors(COUNT, DIM)
    index = GalleryIndex.create(
        tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None, backend="milvus"
    )
    try:
        index.add(vectors, entries(COUNT))
        ids = sorted(item.id for item in index.items.scan())
        judged = [index.judgments.add(JudgedQuery(item=ids[0]), result, 1, "m", TIME) for result in ids[1:3]]
        backend = index.items
        server = backend.client
        raw = server.sibling()  # another client of the server, reading and writing as Milvus's own
        items_collection, judgments_collection = backend.collection, backend.judgments.collection
        lost_item = raw.query(
            items_collection, filter=f"id == {ids[5]}", output_fields=["*"], consistency_level="Strong"
        )
        lost_judgment = raw.query(
            judgments_collection,
            filter=f"id == {judged[1].id}",
            output_fields=["*"],
            consistency_level="Strong",
        )
        assert index.remove([ids[5]]) == 1
        assert index.judgments.remove(judged[1].id)

        # The server brings both back (as Milvus 2.3.5 did across a restart), and the next call connects
        # afresh (as after a failed one); the background re-deletion is held until the reads are checked.
        raw.insert(items_collection, lost_item)
        raw.insert(judgments_collection, lost_judgment)
        held, redeleting = threading.Event(), MilvusTombstones._redelete

        def held_redelete(self: MilvusTombstones, server: object) -> None:
            held.wait(60)
            redeleting(self, server)

        monkeypatch.setattr(MilvusTombstones, "_redelete", held_redelete)
        server._drop(None)

        kept = [i for i in ids if i != ids[5]]
        assert sorted(item.id for item in index.items.scan()) == kept
        assert len(index) == COUNT - 1
        assert index.items.get(ids[5]) is None
        found = {hit.item.id for hit in index.search(vectors[5:6], COUNT)[0]}
        assert found == set(kept)
        assert [j.id for j in index.judgments.scan()] == [judged[0].id]
        assert raw.query(
            items_collection, filter=f"id == {ids[5]}", output_fields=["id"], consistency_level="Strong"
        ), "not brought back"

        held.set()
        wait_until(
            lambda: (
                not raw.query(
                    items_collection,
                    filter=f"id == {ids[5]}",
                    output_fields=["id"],
                    consistency_level="Strong",
                )
                and not raw.query(
                    judgments_collection,
                    filter=f"id == {judged[1].id}",
                    output_fields=["id"],
                    consistency_level="Strong",
                )
            ),
            30,
            "the re-deletion on the server",
        )
        wait_until(
            lambda: backend.tombstones.exclusion(items_collection) is None, 30, "reads to stop leaving out"
        )
        assert sorted(item.id for item in index.items.scan()) == kept
        assert np.isfinite(index.search(vectors[:1], 3)[0][0].score)
        raw.close()
    finally:
        index.close()
