"""Shard directories merge into exactly the index one process builds from the whole gallery."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from index.gallery import GalleryIndex
from index.merge import merge_shards
from index.protocol import Entry
from index.selection import IndexOptions
from index.sharding import Shard
from tests.support.vectors import clustered_vectors, entries

DIM = 16
COUNT = 1500


def _gallery() -> tuple[list[Entry], np.ndarray]:
    rows, vectors = entries(COUNT), clustered_vectors(COUNT, DIM)
    # Two files with the same content in different shards: the merged index keeps the first path only.
    first, twin = next(
        (a, b)
        for a in range(COUNT)
        for b in range(a + 1, COUNT)
        if Shard(0, 2).owns(rows[a].path) != Shard(0, 2).owns(rows[b].path)
    )
    rows[twin] = replace(rows[twin], content_hash=rows[first].content_hash)
    vectors[twin] = vectors[first]
    return rows, vectors


def _create(directory: Path, options: IndexOptions, shard: str | None = None) -> GalleryIndex:
    return GalleryIndex.create(
        directory, dim=DIM, model_fingerprint="m", gallery_root=None, options=options, shard=shard
    )


def _signatures(rows: list[Entry]) -> list[bytes]:
    """A perceptual signature per item, derived from its content (twins share it)."""
    return [row.content_hash.encode().ljust(32, b"-")[:32] for row in rows]


def _snapshot(index: GalleryIndex, queries: np.ndarray) -> tuple[list, list, tuple]:
    signatures = index.signatures()
    items = [(i.id, i.path, i.label, i.content_hash, signatures.get(i.id)) for i in index.items.scan()]
    hits = [[(h.item.id, h.score) for h in row] for row in index.search(queries, 10)]
    m = index.manifest
    return items, hits, (m.built, m.count)


@pytest.mark.parametrize("index_type", ["flat", "ivf", "ivfsq", "ivfpq"])
def test_two_shards_merge_into_the_single_process_index(tmp_path: Path, index_type: str) -> None:
    rows, vectors = _gallery()
    options = IndexOptions(index_type, target_recall=0.9)
    seen: set[str] = set()
    unique = [i for i, row in enumerate(rows) if not (row.content_hash in seen or seen.add(row.content_hash))]
    single = _create(tmp_path / "single", options)
    single_rows = [rows[i] for i in unique]
    single.add(vectors[unique], single_rows, _signatures(single_rows))  # a build adds files in path order
    single.save()
    for number in range(2):
        shard = Shard(number, 2)
        mine = [i for i, row in enumerate(rows) if shard.owns(row.path)]
        part = _create(tmp_path / f"shard{number}", options, shard=str(shard))
        part.add(vectors[mine], [rows[i] for i in mine], _signatures([rows[i] for i in mine]))
        part.save()
        part.close()
    merged = merge_shards([tmp_path / "shard1", tmp_path / "shard0"], tmp_path / "merged", progress=False)
    queries = clustered_vectors(30, DIM, seed=5)
    assert _snapshot(merged, queries) == _snapshot(single, queries)  # signatures included
    assert len(merged) == COUNT - 1 and len(merged.signatures()) == COUNT - 1
    merged.close()
    single.close()


def test_merge_refuses_incomplete_or_mixed_shards(tmp_path: Path) -> None:
    options = IndexOptions("flat")
    for number in range(3):
        part = _create(tmp_path / f"s{number}", options, shard=f"{number}/3")
        part.add(clustered_vectors(5, DIM, seed=number), entries(5, prefix=f"s{number}"))
        part.save()
        part.close()
    whole = _create(tmp_path / "whole", options)
    whole.close()
    with pytest.raises(ValueError, match="exactly once"):
        merge_shards([tmp_path / "s0", tmp_path / "s1"], tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="not a shard"):
        merge_shards([tmp_path / "s0", tmp_path / "whole"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
